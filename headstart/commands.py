"""The verbs behind `headstart <verb>` (headstart.cli builds the parser and dispatches here).

Each `cmd_*` takes the parsed arguments and returns the exit status; heavy imports happen inside,
so `headstart --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from headstart.errors import HeadstartError


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
    from headstart.data.dataset import build_dataset, stats_dict
    from headstart.data.template import mark_supervised
    from headstart.precompute.regenerate import check_regenerated_source
    from headstart.recipe_io import load_recipe

    overrides = list(args.overrides)
    if args.limit is not None:
        overrides.append(f"data.limit={args.limit}")
    recipe = load_recipe(args.recipe, overrides)
    check_regenerated_source(recipe, args.recipe)
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
        ("skipped", f"{sum(s.skipped.values()):,}" + (f"  ({reasons(s.skipped)})" if s.skipped else "")),
        ("repaired", reasons(s.repaired) if s.repaired else "none"),
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
    from headstart.launch import check_world_size

    check_world_size("precompute")
    from headstart.precompute.regenerate import check_regenerated_source
    from headstart.recipe_io import load_recipe

    recipe = load_recipe(action, args.overrides)
    check_regenerated_source(recipe, action)
    manifest = run_precompute(recipe, resume=args.resume, progress=not args.json)
    if args.json and manifest is not None:
        print(json.dumps(summary(manifest), indent=2))
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    from headstart.precompute.regenerate import run_regenerate
    from headstart.recipe_io import load_recipe

    recipe = load_recipe(args.recipe, args.overrides + ([f"regenerate.engine={args.engine}"] if args.engine else []))
    if recipe.regenerate.engine == "vllm":
        from headstart.engines.vllm_runner import vllm_missing

        why = vllm_missing()
        if why:
            raise HeadstartError(f"regenerate --engine vllm: {why}")
    run_regenerate(recipe, resume=args.resume, minutes=args.minutes, pieces=args.pieces)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from headstart.launch import check_train_launch, torchrun_line
    from headstart.precompute.regenerate import check_regenerated_source
    from headstart.recipe_io import load_recipe
    from headstart.train import run_train

    recipe = load_recipe(args.recipe, args.overrides)
    tr = recipe.trainer
    flags = ["--resume"] * args.resume + ["--no-progress"] * args.no_progress
    flags += ["--minutes", str(args.minutes)] if args.minutes is not None else []
    check_train_launch(tr, torchrun_line("train", args.recipe, args.overrides, flags, tr.devices, tr.num_nodes))
    check_regenerated_source(recipe, args.recipe)
    metrics = run_train(recipe, resume=args.resume, progress=not args.no_progress, minutes=args.minutes)
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        keys = ("step", "tokens", "val_loss", "tau", "alpha", "top1_per_step")
        print("train: " + json.dumps({k: metrics.get(k) for k in keys}))
        out = Path(recipe.output_dir)
        heads = [n for n in ("head-final", "head-best") if (out / n / "config.json").is_file()]
        print(f"train: heads in {' and '.join(f'{out}/{n}' for n in heads) or 'none'}; curve in {out}/metrics.csv")
    return 0


def cmd_head_init(args: argparse.Namespace) -> int:
    from headstart.assets import resolve_model
    from headstart.heads import HeadConfig, build_head, save_head
    from headstart.heads.checkpoint import check_head_output
    from headstart.heads.config import EAGLE31_FLAGS, POSTNORM_FAMILIES
    from headstart.models import load_target

    check_head_output(args.out, overwrite=args.force)  # before the target loads: a wrong --out costs nothing
    try:
        if args.postnorm_features and args.type not in POSTNORM_FAMILIES:  # named by the flag, not the field
            raise ValueError(f"--postnorm-features applies to {', '.join(POSTNORM_FAMILIES)} heads, not {args.type}")
        norms = {k: getattr(args, k) for k in EAGLE31_FLAGS if getattr(args, k) is not None}
        for name, value in norms.items():
            if args.type != "eagle3":
                raise ValueError(f"--{'' if value else 'no-'}{name.replace('_', '-')} applies to eagle3 heads, "
                                 f"not {args.type}")
        if args.fc_bias is not None and args.type != "eagle1":
            raise ValueError(f"--{'' if args.fc_bias else 'no-'}fc-bias applies to eagle1 heads, not {args.type}")
        cfg = HeadConfig(head_type=args.type, num_layers=args.num_layers, medusa_num_heads=args.medusa_heads,
                         postnorm_features=True if args.postnorm_features else None, block_size=args.block_size,
                         fc_bias=args.fc_bias, **norms)
    except ValueError as e:
        raise HeadstartError(f"head init: {e}") from None
    target = load_target(resolve_model(args.model), dtype=args.dtype)
    head = build_head(cfg, target)
    path = save_head(head, args.out, overwrite=args.force)
    n = sum(p.numel() for p in head.trainable_parameters())
    print(f"{args.type} head for {args.model} ({n:,} trainable parameters, initialised from the target) -> {path}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import math
    from pathlib import Path

    from headstart.fileio import read_json_object
    from headstart.plan import make_plan, render, target_config_path
    from headstart.recipe_io import load_recipe

    gb = args.device_memory_gb
    if not (math.isfinite(gb) and gb > 0):
        raise HeadstartError(f"--device-memory-gb {gb}: not a memory size; give the device's memory in GB, a positive "
                             "number (e.g. 80 for an H100-80GB)")
    recipe = load_recipe(args.recipe, args.overrides)
    where = Path(args.target_config) if args.target_config else target_config_path(recipe)
    if not where.is_file():
        raise HeadstartError(f"{where}: no such config.json (pass --target-config CONFIG_JSON)")
    plan = make_plan(recipe, read_json_object(where, "model config"), device=args.device_name,
                     capacity_gb=args.device_memory_gb, where=str(where))
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan))
    return 1 if plan.refusals() else 0


def cmd_export(args: argparse.Namespace) -> int:
    from headstart.assets import resolve_model
    from headstart.export import check_export_output, export_head
    from headstart.heads import load_head, read_head_config
    from headstart.models import load_target

    check_export_output(args.out, overwrite=args.force, source=args.head, native=args.format == "native")
    cfg = read_head_config(args.head)
    # A head reads only the target's embedding, final norm and lm_head: the decoder layers stay on disk
    # (a DeepSeek-V3 target is 671 B parameters).
    target = load_target(resolve_model(args.model), dtype="fp32", layers=[])
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
    from headstart.heads.checkpoint import check_head_output
    from headstart.models import load_target

    check_head_output(args.out, overwrite=args.force)
    target = load_target(resolve_model(args.target), dtype="fp32", layers=[])  # what a head reads (see export)
    head = import_head(args.src, args.format, target, args.out, overwrite=args.force,
                       allow_other_target=args.allow_other_target)
    n = sum(p.numel() for p in head.parameters())
    print(f"import: {args.format} checkpoint -> {head.config.head_type} head ({n:,} parameters) at {args.out}")
    return 0


def reasons(skipped: dict[str, int]) -> str:
    return ", ".join(f"{r} {n}" for r, n in sorted(skipped.items(), key=lambda kv: -kv[1]))


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
