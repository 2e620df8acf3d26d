"""`headstart <verb> ...`: one verb per job; every verb that takes a recipe accepts `--set key=value`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from headstart import __version__
from headstart.errors import HeadstartError


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="a YAML recipe, e.g. recipes/smollm2-135m-mtp.yaml")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set data.max_length=512 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headstart",
        description="Train draft heads for speculative decoding and measure them with the engine that serves them.",
    )
    parser.add_argument("--version", action="version", version=f"headstart {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    p = verbs.add_parser("assets", help="prepare and print the embedded defaults (model, data)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_assets)

    p = verbs.add_parser("data", help="inspect what a recipe's data turns into")
    data_verbs = p.add_subparsers(dest="data_verb", metavar="ACTION", required=True)
    q = data_verbs.add_parser(
        "inspect", help="counts (read, skipped by reason, tokens, supervised) and a marked-up sample"
    )
    _add_recipe_args(q)
    q.add_argument("--limit", type=int, default=None, help="read only the first N rows (sets data.limit)")
    q.add_argument("--sample", type=int, default=None, help="index of the training conversation to show")
    q.add_argument("--json", action="store_true", help="print the numbers as JSON (no sample)")
    q.set_defaults(func=cmd_data_inspect)

    p = verbs.add_parser("generate", help="generate completions with headstart's own engine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a user message (chat template applied); repeatable")
    src.add_argument("--prompts", help="JSONL: one {'prompt': ...} or {'messages': [...]} per line (+ id, category)")
    p.add_argument("--model", default="smollm2-135m", help="embedded name or local HF model directory")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seeds sampling (request i uses seed + i)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="auto: bf16 where the device computes it natively, else fp32")
    p.add_argument("--batch-size", type=int, default=8, help="sequences decoded together")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"])
    p.add_argument("--no-batch-invariant", action="store_true",
                   help="CPU: torch's matmuls for prefill (faster long prompts; a token's bits may then depend on "
                        "what shares its step, so greedy speculation can drift from greedy AR)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache budget (default: sized to the batch)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--raw", action="store_true", help="--prompt text is not wrapped in the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, then a summary object")
    p.add_argument("--spec", choices=["chain", "draft", "medusa", "tree"], default=None,
                   help="speculative decoding: a head chain, a draft model, Medusa heads, or an EAGLE-2 tree")
    p.add_argument("--head", default=None, help="head checkpoint directory (--spec chain / medusa / tree)")
    p.add_argument("--draft", default=None, help="draft model: name, HF directory or draft_lm head (--spec draft)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--draft-sampling", action="store_true",
                   help="sample drafts from q and verify with the full-q rule (default: argmax + one-hot rule)")
    p.add_argument("--tree-topk", type=int, default=4, help="--spec tree: children expanded per node")
    p.add_argument("--tree-tokens", type=int, default=16, help="--spec tree: draft tokens verified per step")
    p.add_argument("--tree-depth", type=int, default=5, help="--spec tree: draft depth")
    p.add_argument("--allow-other-target", action="store_true",
                   help="use a head trained for a same-shaped target with other weights (warns)")
    p.set_defaults(func=cmd_generate)

    p = verbs.add_parser(
        "precompute", help="store the target's hidden states for a recipe (or: precompute verify|inspect DIR)",
        description="headstart precompute RECIPE [--resume] | precompute verify DIR | precompute inspect DIR",
    )
    p.add_argument("what", nargs="+", metavar="RECIPE | verify DIR | inspect DIR")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in the same output dir")
    p.add_argument("--no-checksums", action="store_true", help="verify: sizes and shapes only (faster)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_precompute)

    p = verbs.add_parser("regenerate", help="rewrite a recipe's assistant turns with the target itself")
    _add_recipe_args(p)
    p.add_argument("--resume", action="store_true", help="continue an interrupted run")
    p.set_defaults(func=cmd_regenerate)

    p = verbs.add_parser("train", help="fit the recipe's head (shards or online), validating with the engine")
    _add_recipe_args(p)
    p.add_argument("--resume", action="store_true", help="continue from output_dir/checkpoints/last.ckpt")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    p.set_defaults(func=cmd_train)

    p = verbs.add_parser("head", help="create and inspect draft-head checkpoints")
    head_verbs = p.add_subparsers(dest="head_verb", metavar="ACTION", required=True)
    q = head_verbs.add_parser("init", help="build a head for a target (initialised from it) and save it")
    q.add_argument("--model", default="smollm2-135m", help="the target: embedded name or local directory")
    q.add_argument("--type", required=True, choices=["mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm"])
    q.add_argument("--num-layers", type=int, default=1, help="decoder layers (draft_lm: its depth)")
    q.add_argument("--medusa-heads", type=int, default=4)
    q.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="fp32")
    q.add_argument("--out", required=True, help="checkpoint directory to write (a new or empty directory)")
    q.add_argument("--force", action="store_true", help="replace --out if it is an existing head checkpoint")
    q.set_defaults(func=cmd_head_init)

    p = verbs.add_parser("eval", help="acceptance and speed of heads vs plain decoding, with the engine")
    _add_recipe_args(p)
    p.add_argument("--head", action="append", required=True, help="a head checkpoint directory (repeatable)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", help="JSONL with \"prompt\" or \"messages\" (+ optional \"category\") per row")
    src.add_argument("--heldout", type=int, default=32, help="first user turns of N held-out conversations")
    p.add_argument("--k", default="1,2,3,4,5", help="draft lengths (tree: depths), comma-separated")
    p.add_argument("--temperature", default="0", help="temperatures, comma-separated")
    p.add_argument("--spec", default="chain", help="chain and/or tree for chain heads, comma-separated")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", help="report directory (default: <output_dir>/eval)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = verbs.add_parser("export", help="write a head in a serving engine's layout (checked by reading it back)")
    p.add_argument("head", help="a native head checkpoint directory")
    p.add_argument("--format", required=True, choices=["sglang", "vllm", "deepseek-mtp", "medusa", "hf", "native"])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m", help="the head's target: embedded name or local directory")
    p.add_argument("--force", action="store_true", help="replace --out if an earlier export wrote it")
    p.add_argument("--allow-other-target", action="store_true")
    p.set_defaults(func=cmd_export)

    p = verbs.add_parser("import", help="turn a serving-layout checkpoint into a native head")
    p.add_argument("src", help="checkpoint directory (config.json + *.safetensors or pytorch_model*.bin)")
    p.add_argument("--format", required=True, choices=["sglang", "vllm", "eagle", "deepseek-mtp", "medusa", "hf"])
    p.add_argument("--target", default="smollm2-135m", help="the target: embedded name or local directory")
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="replace --out if it is a head checkpoint")
    p.add_argument("--allow-other-target", action="store_true",
                   help="import an export of a head made for a same-shaped target with other weights")
    p.set_defaults(func=cmd_import)
    return parser


def cmd_assets(args: argparse.Namespace) -> int:
    from headstart.assets import prepare_all

    report = prepare_all()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"cache: {report['cache_dir']}")
    for m in report["models"]:
        state = f"converted in {m['seconds']:.1f}s" if m["converted_now"] else "cached"
        print(f"model {m['name']:<14} {m['path']}  ({state}; {m['num_hidden_layers']} layers, "
              f"d={m['hidden_size']}, vocab {m['vocab_size']:,})")
    for d in report["datasets"]:
        state = f"salvaged in {d['seconds']:.1f}s" if d["salvaged_now"] else "cached"
        print(f"data  {d['name']:<14} {d['path']}  ({state}; {d['conversations']:,} complete conversations, "
              f"{d['bytes_unparsed']:,} of {d['bytes_total']:,} bytes at the end unparsable)")
    return 0


def cmd_data_inspect(args: argparse.Namespace) -> int:
    from headstart.config import load_recipe
    from headstart.data.dataset import build_dataset, stats_dict
    from headstart.data.template import mark_supervised

    overrides = list(args.overrides)
    if args.limit is not None:
        overrides.append(f"data.limit={args.limit}")
    recipe = load_recipe(args.recipe, overrides)
    built = build_dataset(recipe.data, recipe.target.model, progress=not args.json)
    s = built.stats
    if args.json:
        print(json.dumps(stats_dict(s), indent=2))
        return 0
    pct = f"{100 * s.supervised_fraction:.1f}%"
    rows = [
        ("recipe", f"{args.recipe} (target {recipe.target.model}, data {recipe.data.source}, "
                   f"max_length {recipe.data.max_length})"),
        ("rows read", f"{s.rows_read:,}"),
        ("conversations", f"{s.conversations:,} kept"),
        ("skipped", f"{sum(s.skipped.values()):,}" + (f"  ({_reasons(s.skipped)})" if s.skipped else "")),
        ("repaired", _reasons(s.repaired) if s.repaired else "none"),
        ("truncated", f"{s.truncated:,} (cut to {recipe.data.max_length} tokens, kept)"),
        ("tokens", f"{s.tokens:,}"),
        ("supervised tokens", f"{s.supervised_tokens:,} ({pct} of tokens)"),
        ("split", f"train {s.train_conversations:,} conversations / {s.train_tokens:,} tokens; "
                  f"held out {s.heldout_conversations:,} / {s.heldout_tokens:,} "
                  f"(heldout_fraction {recipe.data.heldout_fraction}, by id hash)"),
    ]
    if s.unparsed_tail_bytes:
        rows.append(("source tail", f"{s.unparsed_tail_bytes:,} bytes at the end of the file were cut off mid-record"))
    for k, v in rows:
        print(f"{k:<18} {v}")
    for reason, where in s.skipped_examples.items():
        print(f"  {reason}: e.g. {'; '.join(where)}")
    _print_sample(built, args.sample, mark_supervised)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from headstart.data.sources import read_prompts
    from headstart.inference import Engine, SamplingParams
    from headstart.inference.spec import SpecConfig

    if args.prompts:
        read = read_prompts(args.prompts)
        if read.skipped:
            print(f"{args.prompts}: skipped {sum(read.skipped.values())} rows ({_reasons(dict(read.skipped))})",
                  file=sys.stderr)
        if not read.conversations:
            raise HeadstartError(f"{args.prompts}: no usable prompts")
        ids = [c["id"] for c in read.conversations]
        prompts: list = [c["messages"] for c in read.conversations]
    else:
        ids = [str(i) for i in range(len(args.prompt))]
        prompts = list(args.prompt)
    device = _device(args.device)
    try:
        params = [
            SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                           seed=args.seed + i, stop=args.stop)
            for i in range(len(prompts))
        ]
        spec = None
        if args.spec == "tree":
            spec = SpecConfig(method="tree", head=args.head, k=args.tree_depth, tree_topk=args.tree_topk,
                              tree_tokens=args.tree_tokens, allow_other_target=args.allow_other_target)
        elif args.spec is not None:
            spec = SpecConfig(method=args.spec, k=args.k, head=args.head, draft=args.draft,
                              draft_sampling=args.draft_sampling, allow_other_target=args.allow_other_target)
        from headstart.hardware import resolve_dtype

        args.dtype = resolve_dtype(args.dtype, device)
        engine = Engine(args.model, dtype=args.dtype, device=device, backend=args.backend,
                        kv_cache_gb=args.kv_cache_gb, page_size=args.page_size, max_batch_size=args.batch_size,
                        seed=args.seed, spec=spec, batch_invariant=not args.no_batch_invariant)
        chat = not args.raw
        stream = len(prompts) == 1 and not args.json and sys.stdout.isatty()
        printed = [0]

        def on_output(out: Any) -> None:
            if stream:
                print(out.text[printed[0]:], end="", flush=True)
                printed[0] = len(out.text)
            elif not args.json and out.finished:
                print(f"--- [{ids[int(out.id)]}] ({len(out.token_ids)} tokens, {out.finish_reason})")
                print(out.text, flush=True)

        start = time.perf_counter()
        outs = engine.generate(prompts, params, chat=chat, on_output=on_output,
                               request_ids=[str(i) for i in range(len(prompts))])
        seconds = time.perf_counter() - start
    except ValueError as e:
        raise HeadstartError(str(e)) from None
    generated = sum(len(o.token_ids) for o in outs)
    summary: dict[str, Any] = {"tokens_per_s": round(generated / seconds, 2) if seconds else 0.0,
                               "generated_tokens": generated, "seconds": round(seconds, 3)}
    if spec is not None:
        summary.update(engine.spec_metrics.summary())
    if args.json:
        for rid, o in zip(ids, outs):
            row = {"id": rid, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason}
            if o.spec_metrics is not None:
                row["tau"] = o.spec_metrics["tau"]
            print(json.dumps(row))
        print(json.dumps(summary))
    else:
        if stream:
            print()
        print(f"{generated} tokens in {seconds:.2f}s: {summary['tokens_per_s']} tok/s "
              f"({args.dtype}, batch {args.batch_size}, {engine.backend.name} attention on {device})", file=sys.stderr)
        if spec is not None:
            m = summary
            if m["steps"]:
                rate = " ".join(f"{x:.2f}" for x in m["accept_rate_per_pos"])
                cond = " ".join(f"{x:.2f}" for x in m["cond_accept_per_pos"])
                print(f"speculation ({args.spec}): tau {m['tau']:.3f}  alpha {m['alpha']:.3f}  steps {m['steps']}  "
                      f"accept_rate_per_pos [{rate}]  cond_accept_per_pos [{cond}]  "
                      f"accept_histogram {m['accept_histogram']}  draft {m['draft_seconds']:.2f}s  "
                      f"verify {m['verify_seconds']:.2f}s", file=sys.stderr)
            else:
                print(f"speculation ({args.spec}): no decode-only step ran", file=sys.stderr)
    return 0


def cmd_precompute(args: argparse.Namespace) -> int:
    from headstart.precompute import read_manifest, run_precompute, summary, verify

    action = args.what[0]
    if action in ("verify", "inspect"):
        if len(args.what) != 2:
            raise HeadstartError(f"usage: headstart precompute {action} DIR")
        directory = args.what[1]
        manifest = verify(directory, checksums=not args.no_checksums) if action == "verify" else \
            read_manifest(directory)
        info = summary(manifest)
        if args.json:
            print(json.dumps(info, indent=2))
        elif action == "verify":
            print(f"{directory}: OK ({info['shards']} shards, {info['sequences']:,} sequences, "
                  f"{info['tokens']:,} tokens{', checksums verified' if not args.no_checksums else ''})")
        else:
            err = f", fp8 relative error {info['fp8_rel_error']:.4f}" if info["fp8_rel_error"] is not None else ""
            print(f"{directory}\n  sequences {info['sequences']:,}  tokens {info['tokens']:,}  "
                  f"shards {info['shards']}\n"
                  f"  storage {info['dtype']}  {info['bytes_per_token']:.1f} bytes/token  "
                  f"({info['bytes'] / 1e6:.1f} MB){err}\n  hidden size {info['hidden_size']}  "
                  f"aux layers {info['aux_layers']}")
            for k, v in info["fingerprints"].items():
                print(f"  {k + ' fingerprint':<22} {v}")
        return 0
    if len(args.what) != 1:
        raise HeadstartError("usage: headstart precompute RECIPE [--resume] [--set key=value]")
    from headstart.config import load_recipe

    recipe = load_recipe(action, args.overrides)
    manifest = run_precompute(recipe, resume=args.resume, progress=not args.json)
    if args.json and manifest is not None:
        print(json.dumps(summary(manifest), indent=2))
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    from headstart.config import load_recipe
    from headstart.precompute.regenerate import run_regenerate

    recipe = load_recipe(args.recipe, args.overrides)
    run_regenerate(recipe, resume=args.resume)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from headstart.config import load_recipe
    from headstart.train import run_train

    recipe = load_recipe(args.recipe, args.overrides)
    metrics = run_train(recipe, resume=args.resume, progress=not args.no_progress)
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        keys = ("step", "tokens", "val_loss", "tau", "alpha", "top1_per_step")
        print("train: " + json.dumps({k: metrics.get(k) for k in keys}))
        print(f"train: heads in {recipe.output_dir}/head-final and head-best; curve in {recipe.output_dir}/metrics.csv")
    return 0


def cmd_head_init(args: argparse.Namespace) -> int:
    from headstart.assets import resolve_model
    from headstart.heads import HeadConfig, build_head, save_head
    from headstart.heads.base import check_head_output
    from headstart.models.llama import load_llama

    check_head_output(args.out, overwrite=args.force)  # before the target loads: a wrong --out costs nothing
    try:
        cfg = HeadConfig(head_type=args.type, num_layers=args.num_layers, medusa_num_heads=args.medusa_heads)
    except ValueError as e:
        raise HeadstartError(f"head init: {e}") from None
    target = load_llama(resolve_model(args.model), dtype=args.dtype)
    head = build_head(cfg, target)
    path = save_head(head, args.out, overwrite=args.force)
    n = sum(p.numel() for p in head.trainable_parameters())
    print(f"{args.type} head for {args.model} ({n:,} trainable parameters, initialised from the target) -> {path}")
    return 0


def _csv(text: str, kind: type, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HeadstartError(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}") from None


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from headstart.assets import resolve_model
    from headstart.config import load_recipe
    from headstart.evaluate import EvalPlan, check_plan, evaluate, read_prompt_file, write_reports
    from headstart.hardware import resolve_dtype
    from headstart.models.llama import load_llama

    recipe = load_recipe(args.recipe, args.overrides)
    plan = EvalPlan(heads=args.head, ks=_csv(args.k, int, "--k"), temperatures=_csv(args.temperature, float,
                    "--temperature"), methods=_csv(args.spec, str, "--spec"), batch_size=args.batch_size,
                    max_tokens=args.max_tokens, seed=recipe.seed)
    check_plan(plan)
    for h in plan.heads:
        if not (Path(h) / "config.json").is_file():
            raise HeadstartError(f"--head {h}: not a head checkpoint directory")
    model_dir = resolve_model(recipe.target.model)
    device = _device(args.device)
    dtype = resolve_dtype(recipe.target.dtype, device)
    target = load_llama(model_dir, dtype=dtype, device=device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if args.prompts:
        rows = read_prompt_file(args.prompts)
        prompts = []
        for r in rows:
            msgs = r["messages"] if "messages" in r else [{"role": "user", "content": r["prompt"]}]
            out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
            prompts.append(list(out["input_ids"] if hasattr(out, "keys") else out))
        categories = [r.get("category") for r in rows]
        source = str(args.prompts)
    else:
        from headstart.data.dataset import build_dataset
        from headstart.train.validate import heldout_prompts

        built = build_dataset(recipe.data, str(model_dir), progress=not args.no_progress)
        prompts = heldout_prompts([list(x) for x in built.heldout["input_ids"]],
                                  [list(x) for x in built.heldout["loss_mask"]], args.heldout)
        categories = [None] * len(prompts)
        source = f"{recipe.data.source} held-out, first {len(prompts)} first user turns"
    print(f"eval: {len(prompts)} prompts ({source}); target {recipe.target.model} in {dtype}")
    info = {"target": recipe.target.model, "dtype": dtype, "device": device, "prompt_source": source,
            "target_fingerprint": target.fingerprint(), "recipe": str(args.recipe), "headstart": __version__}
    report = evaluate(target, tokenizer, prompts, categories, plan, progress=not args.no_progress, info=info)
    out = Path(args.out or Path(recipe.output_dir) / "eval")
    files = write_reports(report, out)
    for r in report["runs"]:
        tau = f"{r['tau']:.3f}" if r["tau"] is not None else "- (no speculative step)"
        print(f"eval: {Path(r['head']).name} {r['method']} k={r['k']} T={r['temperature']}: tau {tau}, "
              f"{r['tokens_per_s']:.1f} tok/s vs AR {r['ar_tokens_per_s']:.1f} = {r['speedup']:.2f}x"
              + (f", lossless_check {r['lossless_check']}" if "lossless_check" in r else ""))
    print("eval: wrote " + ", ".join(str(f) for f in files))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from headstart.assets import resolve_model
    from headstart.export import check_export_output, export_head
    from headstart.heads import load_head, read_head_config
    from headstart.models.llama import load_llama

    check_export_output(args.out, overwrite=args.force, source=args.head, native=args.format == "native")
    cfg = read_head_config(args.head)
    target = load_llama(resolve_model(args.model), dtype="fp32")
    head = load_head(args.head, target, allow_other_target=args.allow_other_target)
    target = target.to(head.dtype)
    info = export_head(head, target, args.format, args.out, overwrite=args.force, source=args.head)
    print(f"export: {cfg.head_type} head -> {args.format} at {info['out']} ({info['tensors']} tensors; read back: "
          f"logits {info['roundtrip']})")
    if args.format == "deepseek-mtp" and cfg.head_type == "mtp":
        print("export: note: DeepSeek MTP loaders zero the embedding at position 0; this mtp head was trained "
              "without that, and since every later row attends to row 0, its drafts in such a server differ "
              "slightly from ours (acceptance may drop a little); a deepseek_mtp head matches exactly")
    if args.format == "vllm" and cfg.head_type == "mtp":
        print("export: note: speculators' mtp feeds its final-normed output to the next draft step; this head "
              "feeds back its pre-norm output, so step 1 matches exactly and later steps differ in vLLM")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from headstart.assets import resolve_model
    from headstart.export import import_head
    from headstart.heads.base import check_head_output
    from headstart.models.llama import load_llama

    check_head_output(args.out, overwrite=args.force)
    target = load_llama(resolve_model(args.target), dtype="fp32")
    head = import_head(args.src, args.format, target, args.out, overwrite=args.force,
                       allow_other_target=args.allow_other_target)
    n = sum(p.numel() for p in head.parameters())
    print(f"import: {args.format} checkpoint -> {head.config.head_type} head ({n:,} parameters) at {args.out}")
    return 0


def _reasons(skipped: dict[str, int]) -> str:
    return ", ".join(f"{r} {n}" for r, n in sorted(skipped.items(), key=lambda kv: -kv[1]))


def _device(name: str | None) -> str:
    """--device: cpu or cuda[:N], checked (default: cuda if available)."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise HeadstartError(f"--device {name[:40]!r}: not a device; use cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise HeadstartError(f"--device {name[:40]!r}: headstart runs on cpu or cuda[:N]")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise HeadstartError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise HeadstartError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) are visible")
    return name


def _print_sample(built: Any, index: int | None, mark: Any) -> None:
    ds = built.train if len(built.train) else built.heldout
    if index is None:
        # Prefer a short multi-turn conversation: it shows every kind of span in a few lines.
        index = 0
        for i in range(min(len(ds), 500)):
            row = ds[i]
            turns = sum(1 for a, b in zip([0] + row["loss_mask"], row["loss_mask"]) if b and not a)
            if turns >= 2 and row["num_tokens"] <= 400:
                index = i
                break
    if not 0 <= index < len(ds):
        raise HeadstartError(f"--sample {index}: out of range (0..{len(ds) - 1})")
    row = ds[index]
    print(f"\nsample {index} (id {row['id']}, {row['num_tokens']} tokens, {row['num_supervised']} supervised; "
          "supervised spans are marked ⟦...⟧):\n")
    print(mark(built.tokenizer, row["input_ids"], row["loss_mask"], color=sys.stdout.isatty()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HeadstartError as e:
        print(f"headstart: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("headstart: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
