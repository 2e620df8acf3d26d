"""Training throughput and peak memory of the mtp head (eagle3 beside it) on SmolLM2-135M: today's step (full
vocabulary, one step) against the new ones (a draft vocabulary, TTT), from shards (target states
precomputed; the step is the head's work only) and online (the target runs inside the step), plus
the plain loss that materialises full logits. Same batches, one run; each variant in its own process
so its peak RSS is its own.

    .venv/bin/python benchmarks/train.py                     # 4096-token batches, 3 timed steps each
    .venv/bin/python benchmarks/train.py --steps 2 --variants full_ttt1,vd8192_ttt1
    .venv/bin/python benchmarks/train.py --baseline 91e691a --variants vd8192_ttt3,eagle3_vd8192_ttt3

With --baseline REV each variant also runs on the headstart of that git revision (checked out into a
temporary worktree; this script drives both), and the table is ours vs that tree's step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {  # name: (draft vocab, ttt steps, source, loss, head family)
    "full_ttt1": (None, 1, "shards", "ours", "mtp"),
    "plain_full_ttt1": (None, 1, "shards", "plain", "mtp"),
    "vd8192_ttt1": (8192, 1, "shards", "ours", "mtp"),
    "vd8192_ttt3": (8192, 3, "shards", "ours", "mtp"),
    "online_full_ttt1": (None, 1, "online", "ours", "mtp"),
    "online_vd8192_ttt1": (8192, 1, "online", "ours", "mtp"),
    # EAGLE-3 (three fused aux layers, its own 8,192-row lm_head) from shards that hold the aux states
    "eagle3_vd8192_ttt1": (8192, 1, "shards", "ours", "eagle3"),
    "eagle3_vd8192_ttt2": (8192, 2, "shards", "ours", "eagle3"),
    "eagle3_vd8192_ttt3": (8192, 3, "shards", "ours", "eagle3"),
    "online_eagle3_vd8192_ttt2": (8192, 2, "online", "ours", "eagle3"),  # the eagle31 recipes' step, target inside
    "eagle3_vd8192_ttt2_lk": (8192, 2, "shards", "ours_lk", "eagle3"),  # the same step with train.loss lk (LK lambda)
}
BASELINE = "full_ttt1"


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_variant(variant: str, batch_tokens: int, steps: int) -> dict:
    import torch

    from headstart.assets import resolve_model
    from headstart.data.dataset import build_dataset
    from headstart.hardware import describe, resolve_dtype
    from headstart.heads import HeadConfig, PackedBatch, build_head, build_vocab_maps
    from headstart.models.llama import load_llama
    from headstart.recipe_io import recipe_from_dict
    from headstart.train.data import PackedStream, TokenSequences
    from headstart.train.losses import target_logits
    from headstart.train.module import HeadModule, target_forward
    from headstart.train.ttt import unroll

    vocab_size, ttt, source, loss_kind, family = VARIANTS[variant]
    recipe = recipe_from_dict({
        "data": {"source": "sharegpt", "max_length": 1024, "limit": 400},
        "train": {"source": source, "batch_tokens": batch_tokens, "ttt_steps": ttt,
                  "loss": "lk" if loss_kind == "ours_lk" else "kl",
                  "loss_weights": {"kl": 1.0, "feature": 0.1}}})
    dtype = resolve_dtype("auto")
    target = load_llama(resolve_model("smollm2-135m"), dtype)
    head = build_head(HeadConfig(head_type=family, draft_vocab_size=vocab_size), target).float()
    aux_layers = list(head.config.aux_layer_ids or [])
    built = build_dataset(recipe.data, str(resolve_model("smollm2-135m")), progress=False)
    if vocab_size:
        counts = torch.zeros(target.config.vocab_size, dtype=torch.float64)
        for ids, mask in zip(built.train["input_ids"], built.train["loss_mask"]):
            counts += torch.bincount(torch.tensor(ids)[torch.tensor(mask, dtype=torch.bool)],
                                     minlength=counts.numel()).double()
        head.set_vocab_maps(*build_vocab_maps(counts, vocab_size))
    stream = PackedStream(TokenSequences.from_dataset(built.train), batch_tokens, seed=0)
    module = HeadModule(recipe, target, head)
    opt = torch.optim.AdamW(head.trainable_parameters(), lr=1e-4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    batches = []
    for item in stream:
        b = item["batch"]
        if source == "shards":  # what a shard holds: the target's states, stored in bf16
            with torch.no_grad(), autocast:
                full = target_forward(target, b, aux_layers)
            aux = full.aux_hidden.to(torch.bfloat16) if aux_layers else None
            b = PackedBatch(full.input_ids, full.seq_lens, full.hidden.to(torch.bfloat16), aux, full.loss_mask)
        batches.append(b)
        if len(batches) == steps + 1:
            break

    def plain_loss(b):
        b = target_forward(target, b, []) if b.hidden is None else b
        outs, valid, sh = unroll(head, b, 1)
        th = b.hidden[sh.target_rows]
        rows = torch.nonzero(sh.token_mask > 0).flatten()
        logq = torch.log_softmax(head.compute_logits(outs[0][rows]), -1)  # (R, V) kept for backward
        with torch.no_grad():
            logp = torch.log_softmax(target_logits(head, th[rows]), -1)
        return (logp.exp() * (logp - logq)).sum(-1).mean()

    def ours_loss(b):
        loss, _ = module.losses(b, with_stats=False)
        return loss

    loss_fn = ours_loss if loss_kind.startswith("ours") else plain_loss
    base = _rss_mb()
    tokens, start = 0, None
    for i, b in enumerate(batches):
        if i == 1:
            start = time.perf_counter()  # the first step warms up
        with autocast:
            loss = loss_fn(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 1:
            tokens += b.input_ids.numel()
    secs = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "tokens_per_s": tokens / secs, "peak_rss_mb": peak, "step_rss_growth_mb": peak - base,
            "dtype": dtype, "device": describe("cpu"), "torch_threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--baseline", help="a git revision whose training step each variant is also timed on")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.batch_tokens, args.steps)))
        return
    if args.baseline:
        compare_trees(args)
        return
    names = args.variants.split(",")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    results = {}
    for v in names:
        out = subprocess.run([sys.executable, __file__, "--variant", v, "--batch-tokens", str(args.batch_tokens),
                              "--steps", str(args.steps)], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{v} failed:\n{out.stderr[-3000:]}")
        results[v] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[v]
        if v == names[0]:
            print(f"head training step, SmolLM2-135M target, {args.batch_tokens}-token batches, {r['dtype']}, "
                  f"{r['device']}, {r['torch_threads']} threads, {args.steps} timed steps; ratios vs {BASELINE} "
                  "(today's step: full vocabulary, no TTT, chunked loss)")
            print(f"{'variant':<22}{'tokens/s':>10}{'ratio':>8}{'peak RSS MB':>13}{'ratio':>8}")
        b = results[BASELINE]
        print(f"{v:<22}{r['tokens_per_s']:>10.1f}{r['tokens_per_s'] / b['tokens_per_s']:>8.2f}"
              f"{r['peak_rss_mb']:>13.0f}{r['peak_rss_mb'] / b['peak_rss_mb']:>8.2f}", flush=True)


def _time_in(tree: Path, variant: str, args: argparse.Namespace) -> dict:
    """One variant in its own process, on the headstart package of `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--variant", variant, "--batch-tokens", str(args.batch_tokens),
                          "--steps", str(args.steps)], capture_output=True, text=True, cwd=tree, env=env)
    if out.returncode != 0:
        sys.exit(f"{variant} on {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_trees(args: argparse.Namespace) -> None:
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="headstart-train-base-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.baseline], cwd=root, check=True)
        try:
            rows = [(v, _time_in(base, v, args), _time_in(root, v, args)) for v in args.variants.split(",")]
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=root, check=False)
    r = rows[0][2]
    print(f"head training step, SmolLM2-135M target, {args.batch_tokens}-token batches, {r['dtype']}, {r['device']}, "
          f"{r['torch_threads']} threads, {args.steps} timed steps: baseline {args.baseline} vs this tree")
    print("| variant | tokens/s before | after | after / before | peak RSS MB before | after |")
    print("|---|---|---|---|---|---|")
    for v, b, a in rows:
        ratio = a["tokens_per_s"] / b["tokens_per_s"]
        print(f"| {v} | {b['tokens_per_s']:.0f} | {a['tokens_per_s']:.0f} | {ratio:.2f}x | {b['peak_rss_mb']:.0f} | "
              f"{a['peak_rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
