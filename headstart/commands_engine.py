"""The verbs that decode with the engine: `headstart generate` and `headstart eval` (headstart.cli
dispatches here; the other verbs are in headstart.commands). Heavy imports happen inside each verb.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from headstart import __version__
from headstart.commands import reasons
from headstart.errors import ConfigError, HeadstartError


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from headstart.data.sources import read_prompts
    from headstart.inference import Engine, SamplingParams
    from headstart.inference.speculation import SpecConfig

    if args.prompts:
        read = read_prompts(args.prompts)
        if read.skipped:
            print(f"{args.prompts}: skipped {sum(read.skipped.values())} rows ({reasons(dict(read.skipped))})",
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
        if args.draft_threshold is not None and args.spec not in ("chain", "draft"):
            raise HeadstartError(f"--draft-threshold applies to --spec chain or draft, not {args.spec or 'no --spec'}")
        if args.spec == "tree":
            spec = SpecConfig(method="tree", head=args.head, k=args.tree_depth, tree_topk=args.tree_topk,
                              tree_tokens=args.tree_tokens, allow_other_target=args.allow_other_target)
        elif args.spec is not None:
            spec = SpecConfig(method=args.spec, k=args.k, head=args.head, draft=args.draft,
                              draft_sampling=args.draft_sampling, allow_other_target=args.allow_other_target,
                              draft_threshold=args.draft_threshold)
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


def _csv(text: str, kind: type, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HeadstartError(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}") from None


def _heldout_turn(args: argparse.Namespace) -> int:
    """--heldout-turn, checked before anything loads (1 when not given)."""
    if args.heldout_turn is not None and args.prompts:
        raise ConfigError(f"--heldout-turn {args.heldout_turn}: picks held-out turns; not with --prompts")
    if not args.prompts and args.heldout < 1:
        raise ConfigError(f"--heldout {args.heldout}: must be >= 1")
    turn = 1 if args.heldout_turn is None else args.heldout_turn
    if turn < 1:
        raise ConfigError(f"--heldout-turn {turn}: must be >= 1")
    return turn


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from headstart.assets import resolve_model
    from headstart.eval_report import check_report_dir, head_labels, write_reports
    from headstart.evaluate import EvalPlan, check_plan, evaluate, read_prompt_file
    from headstart.fileio import read_json_object
    from headstart.hardware import resolve_dtype
    from headstart.launch import check_world_size
    from headstart.models import load_target
    from headstart.precompute.regenerate import check_regenerated_source
    from headstart.recipe_io import load_recipe

    check_world_size("eval")
    turn = _heldout_turn(args)
    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.data.max_turns is not None and turn > recipe.data.max_turns:
        raise ConfigError(f"--heldout-turn {turn}: the recipe keeps data.max_turns {recipe.data.max_turns} replies "
                          "per conversation (--set data.max_turns=null asks later turns)")
    if not args.prompts:  # the held-out prompts come from data.source
        check_regenerated_source(recipe, args.recipe)
    plan = EvalPlan(heads=args.head, ks=_csv(args.k, int, "--k"), temperatures=_csv(args.temperature, float,
                    "--temperature"), methods=_csv(args.spec, str, "--spec"), batch_size=args.batch_size,
                    max_tokens=args.max_tokens, seed=recipe.seed, allow_other_target=args.allow_other_target,
                    baseline=not args.no_baseline, repeats=args.repeats, draft_threshold=args.draft_threshold,
                    tree_tokens=args.tree_tokens, tree_topk=args.tree_topk, backend=recipe.engine.backend,
                    engines=[e.strip() for e in _csv(args.engine, str, "--engine")], vllm_threads=args.vllm_threads)
    check_plan(plan)
    for h in plan.heads:
        if not (Path(h) / "config.json").is_file():
            raise HeadstartError(f"--head {h}: not a head checkpoint directory")
    out = check_report_dir(args.out or Path(recipe.output_dir) / "eval")  # before anything loads
    plan.workdir = str(out)
    if "vllm" in plan.engines:
        if recipe.engine.tensor_parallel > 1:
            raise HeadstartError("eval --engine vllm: not with engine.tensor_parallel > 1 (every rank would start "
                                 "vLLM); run vLLM's rows in a one-process eval")
        _check_vllm_heads(plan.heads)
    if args.prompts:
        rows = read_prompt_file(args.prompts)
    model_dir = resolve_model(recipe.target.model)
    context = read_json_object(model_dir / "config.json", "model config").get("max_position_embeddings")
    check_plan(plan, context if isinstance(context, int) else None)
    tp = _tensor_parallel(recipe, "eval")
    device = _device(args.device, tp)
    dtype = resolve_dtype(recipe.target.dtype, device)
    target = load_target(model_dir, dtype=dtype, device=device, tp=tp)
    import torch

    from headstart.inference.backends import check_backend

    check_backend(recipe.engine.backend, torch.device(device), target)  # before any prompt or head is read
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if args.prompts:
        prompts = []
        for r in rows:
            msgs = r["messages"] if "messages" in r else [{"role": "user", "content": r["prompt"]}]
            enc = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
            prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
        categories = [r.get("category") for r in rows]
        source = str(args.prompts)
    else:
        from headstart.data.dataset import build_dataset
        from headstart.train.validate import heldout_prompts

        built = build_dataset(recipe.data, str(model_dir), progress=not args.no_progress)
        prompts = heldout_prompts([list(x) for x in built.heldout["input_ids"]],
                                  [list(x) for x in built.heldout["loss_mask"]], args.heldout, turn)
        if not len(built.heldout):
            raise ConfigError(f"--heldout: {recipe.data.source} holds no held-out conversation (data.heldout_fraction "
                              f"{recipe.data.heldout_fraction}); give --prompts or a larger fraction")
        if not prompts:
            raise ConfigError(f"--heldout-turn {turn}: none of the {len(built.heldout):,} held-out conversations of "
                              f"{recipe.data.source} has {turn} replies within data.max_length "
                              f"{recipe.data.max_length}")
        categories = [None] * len(prompts)
        source = (f"{recipe.data.source} held-out, first {len(prompts)} first user turns" if turn == 1
                  else f"{recipe.data.source} held-out, {len(prompts)} user turns before reply {turn} (with the "
                       "earlier turns)")
    lead = tp.rank == 0  # every rank runs the same eval in step; rank 0 reports it
    if lead:
        print(f"eval: {len(prompts)} prompts ({source}); target {recipe.target.model} in {dtype}"
              + (f", tensor-parallel over {tp.size} ranks" if tp.enabled else ""), file=sys.stderr)
    info = {"target": recipe.target.model, "model_dir": str(model_dir), "dtype": dtype, "device": device,
            "prompt_source": source,
            "target_fingerprint": target.fingerprint(), "recipe": str(args.recipe), "headstart": __version__,
            "tensor_parallel": tp.size}
    report = evaluate(target, tokenizer, prompts, categories, plan, progress=lead and not args.no_progress, info=info)
    if not lead:
        return 0
    files = write_reports(report, out)
    labels = head_labels(plan.heads)
    for r in report["runs"]:
        tau = f"{r['tau']:.3f}" if r["tau"] is not None else "- (no speculative step)"
        print(f"eval: {r.get('engine', 'headstart')}: {labels.get(r['head'], r['label'])} {r['method']} k={r['k']} "
              f"T={r['temperature']}: tau {tau}, "
              f"{r['tokens_per_s']:.1f} tok/s vs AR {r['ar_tokens_per_s']:.1f} = {r['speedup']:.2f}x "
              f"(middle half {r['speedup_p25']:.2f}..{r['speedup_p75']:.2f})"
              + (f", lossless_check {r['lossless_check']}" if "lossless_check" in r else "")
              + (f" (in {report['vllm']['dtype']}: {r['lossless_check_run_dtype']})"
                 if r.get("lossless_check_run_dtype", r.get("lossless_check")) != r.get("lossless_check") else "")
              + (f"; vLLM tau - ours {r['tau_minus_headstart']:+.3f} ("
                 + ("noise not assessable: fewer than 2 batch groups" if r["tau_noise"] is None else
                    f"noise +-{r['tau_noise']:.3f}{': MORE THAN THE NOISE' if r['tau_differs'] else ''}") + ")"
                 if "tau_minus_headstart" in r else ""))
    print("eval: wrote " + ", ".join(str(f) for f in files))
    return 0


def _check_vllm_heads(heads: list[str]) -> None:
    """Before any model loads: vLLM is runnable, and each head's family is one vLLM serves."""
    from headstart.engines.vllm_runner import vllm_missing, vllm_refusal
    from headstart.heads import read_head_config

    why = vllm_missing()
    if why:
        raise HeadstartError(f"eval --engine vllm: {why}")
    for h in heads:
        why = vllm_refusal(read_head_config(h).head_type)
        if why:
            print(f"eval: vLLM will skip --head {h}: {why}", file=sys.stderr)


def _tensor_parallel(recipe: Any, verb: str) -> Any:
    """This process's place in the target's tensor-parallel group (engine.tensor_parallel ranks,
    launched with torchrun); `verb` runs one model copy, so the launch must be exactly one group."""
    from headstart.nn.parallel import init_tensor_parallel

    try:
        tp, _, copies = init_tensor_parallel(recipe.engine.tensor_parallel)
    except ValueError as e:
        raise HeadstartError(f"engine.tensor_parallel: {e}") from None
    if copies > 1:
        raise HeadstartError(f"{verb} runs one copy of the target: launch exactly engine.tensor_parallel = "
                             f"{tp.size} processes (torchrun --nproc-per-node {tp.size}), not {copies * tp.size}")
    return tp


def _device(name: str | None, tp: Any = None) -> str:
    """--device: cpu or cuda[:N], checked (default: cuda if available; a tensor-parallel rank takes
    the GPU its launcher's LOCAL_RANK names)."""
    import os

    import torch

    if name is None:
        if tp is not None and tp.enabled and torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            return f"cuda:{local}"
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
