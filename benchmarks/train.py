"""Training step throughput and peak memory: our chunked loss (logits recomputed per chunk in the
backward pass, never a [tokens x vocab] tensor kept) vs a plain step that materialises the full
logits of head and target, same head, same batches, one run. Each variant runs in its own process
so its peak RSS is its own.

    .venv/bin/python benchmarks/train.py                   # SmolLM2-135M, mtp head, 4096-token batches
    .venv/bin/python benchmarks/train.py --batch-tokens 2048 --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_variant(variant: str, batch_tokens: int, steps: int) -> dict:
    import torch

    from headstart.assets import resolve_model
    from headstart.config import recipe_from_dict
    from headstart.data.dataset import build_dataset
    from headstart.hardware import describe, resolve_dtype
    from headstart.heads import build_head, head_config_from_recipe
    from headstart.models.llama import load_llama
    from headstart.train.data import PackedStream, TokenSequences
    from headstart.train.losses import target_logits
    from headstart.train.module import HeadModule, target_forward
    from headstart.train.ttt import unroll

    recipe = recipe_from_dict({
        "output_dir": "/tmp/headstart-bench-train", "data": {"source": "sharegpt", "max_length": 1024, "limit": 400},
        "train": {"source": "online", "batch_tokens": batch_tokens, "val_prompts": 0},
        "logging": {"wandb": False}})
    dtype = resolve_dtype("auto")
    target = load_llama(resolve_model("smollm2-135m"), dtype)
    head = build_head(head_config_from_recipe(recipe.head), target).float()
    built = build_dataset(recipe.data, str(resolve_model("smollm2-135m")), progress=False)
    stream = PackedStream(TokenSequences.from_dataset(built.train), batch_tokens, seed=0)
    module = HeadModule(recipe, target, head)
    opt = torch.optim.AdamW(head.trainable_parameters(), lr=1e-4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    batches = []
    for item in stream:
        with torch.no_grad(), autocast:
            batches.append(target_forward(target, item["batch"], []))
        if len(batches) == steps + 1:
            break

    def plain_loss(b):
        outs, valid, sh = unroll(head, b, 1)
        th = b.hidden[sh.target_rows]
        rows = torch.nonzero(sh.token_mask > 0).flatten()
        logq = torch.log_softmax(head.compute_logits(outs[0][rows]), -1)  # (R, V) kept for backward
        with torch.no_grad():
            logp = torch.log_softmax(target_logits(head, th[rows]), -1)
        return (logp.exp() * (logp - logq)).sum(-1).mean()

    recipe.train.loss_weights.feature = 0.0  # both variants: the KL alone

    def ours_loss(b):
        loss, _ = module.losses(b, with_stats=False)
        return loss

    loss_fn = ours_loss if variant == "ours" else plain_loss
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
            "loss": float(loss), "dtype": dtype, "device": describe("cpu"), "steps": steps,
            "batch_tokens": batch_tokens, "torch_threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variant", choices=["ours", "plain"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.batch_tokens, args.steps)))
        return
    results = {}
    for v in ("ours", "plain"):
        out = subprocess.run([sys.executable, __file__, "--variant", v, "--batch-tokens", str(args.batch_tokens),
                              "--steps", str(args.steps)], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{v} failed:\n{out.stderr[-3000:]}")
        results[v] = json.loads(out.stdout.strip().splitlines()[-1])
    o, p = results["ours"], results["plain"]
    print(f"training step, SmolLM2-135M target, mtp head, {args.batch_tokens}-token batches, {o['dtype']}, "
          f"{o['device']}, {o['torch_threads']} threads, {args.steps} timed steps")
    print(f"{'':28}{'ours (chunked)':>16}{'plain (full logits)':>22}{'ratio':>8}")
    ot, pt, om, pm = o["tokens_per_s"], p["tokens_per_s"], o["peak_rss_mb"], p["peak_rss_mb"]
    print(f"{'tokens/s':28}{ot:>16.1f}{pt:>22.1f}{ot / pt:>8.2f}")
    print(f"{'peak RSS (MB)':28}{om:>16.0f}{pm:>22.0f}{om / pm:>8.2f}")
    print(f"{'RSS growth in the steps (MB)':28}{o['step_rss_growth_mb']:>16.0f}{p['step_rss_growth_mb']:>22.0f}")


if __name__ == "__main__":
    main()
