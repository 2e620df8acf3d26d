"""DFlash (block-parallel drafting) against the best autoregressive head at equal training CPU time,
measured in one run with the engine on the same held-out prompts: tau, draft time per step and the
speedup over plain decoding of each, side by side with their ratio.

The arms are the repository's recipes with only the data and the budget changed:
- `dflash`: recipes/smollm2-135m-dflash.yaml (2 layers, block 4 = 3 drafts per forward, lr 4e-3);
- `mtp`: recipes/smollm2-135m-mtp.yaml at lr 4e-3, the best arm of benchmarks/head_budget.md.
Both train from the same shards (the first --limit embedded ShareGPT conversations, precomputed once
with the last hidden state and dflash's three aux layers; the mtp arm reads only the former). Equal CPU
time: a short probe of each arm (--probe-steps, same shards, quiet machine) measures its training
tokens/s; the mtp arm gets --steps and the dflash arm the steps its measured cost buys in the same time.
Steps, not a clock, then set each budget, so a loaded machine slows an arm without changing what it
learns. `headstart eval` runs both heads and plain decoding together (greedy, k = 3, one prompt at a time).

    .venv/bin/python benchmarks/dflash.py --steps 400
    .venv/bin/python benchmarks/dflash.py --source online --steps 120 --limit 2200 --probe-steps 8

Everything lands under runs/dflash-bench/ (--source online: runs/dflash-bench-online/, the target run in
every training step instead of shards) and resumes: rerunning skips what is done.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from headstart.fileio import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "dflash-bench"


SOURCE = {"train": "shards"}  # --source


def _recipe(arm: str, name: str, limit: int, **train: object) -> Path:
    r = yaml.safe_load((ROOT / "recipes" / f"smollm2-135m-{arm}.yaml").read_text())
    r.pop("regenerate", None)
    r["name"] = f"dflash-bench-{name}"
    r["output_dir"] = str(OUT / name)
    r["data"].update(source="sharegpt", limit=limit, split_key="id_prefix")
    r["data"]["max_length"] = 1024 if SOURCE["train"] == "shards" else 512
    r["train"].update(source=SOURCE["train"], lr=0.004, val_every_steps=0, ckpt_every_steps=20, **train)
    if SOURCE["train"] == "shards":
        r["train"]["shards_dir"] = str(OUT / "shards" / "precompute")
    r["logging"]["wandb"] = False
    if name.startswith("probe-"):
        r["logging"]["every_steps"] = 2
    path = OUT / f"{name}.yaml"
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(r, sort_keys=False))
    return path


def _headstart(*args: str) -> None:
    print("+ headstart", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "headstart.cli", *args], check=True, cwd=ROOT)


def _train(path: Path, out: Path) -> None:
    if (out / "head-final" / "config.json").exists():
        print(f"{out.name}: trained already")
        return
    resume = ["--resume"] if (out / "checkpoints" / "last.ckpt").exists() else []
    _headstart("train", str(path), "--no-progress", *resume)


def _probe_rate(arm: str, steps: int, limit: int) -> float:
    """Training tokens/s of `arm` over a short run from the shards (the first logged rows skipped)."""
    out = OUT / f"probe-{arm}"
    _train(_recipe(arm, f"probe-{arm}", limit, max_steps=steps, warmup_steps=2, val_prompts=1, val_max_tokens=4,
                   val_loss_batches=1), out)
    rows = [r.split(",") for r in (out / "metrics.csv").read_text().splitlines()[1:] if r.startswith("train,")]
    rates = [float(r[5]) for r in rows[1:]]
    return sum(rates) / len(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="steps of the mtp arm (dflash: what the same time buys)")
    ap.add_argument("--limit", type=int, default=4000, help="ShareGPT conversations to precompute and train on")
    ap.add_argument("--probe-steps", type=int, default=12)
    ap.add_argument("--cost", type=float, default=None,
                    help="a dflash step in mtp steps, measured before on a quiet machine (skips the probe, whose "
                         "timing a loaded machine spoils)")
    ap.add_argument("--heldout", type=int, default=16, help="held-out prompts for the engine's figures")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--source", choices=["shards", "online"], default="shards",
                    help="online: the target runs in every training step (no precompute; ~4x slower steps here)")
    args = ap.parse_args()
    global OUT
    SOURCE["train"] = args.source
    if args.source == "online":
        OUT = OUT.with_name(OUT.name + "-online")
    shards = _recipe("dflash", "shards", args.limit)
    if args.source == "shards" and not (OUT / "shards" / "precompute" / "manifest.json").exists():
        resume = ["--resume"] if (OUT / "shards" / "precompute" / "run.json").exists() else []
        _headstart("precompute", str(shards), *resume)
    if args.cost is None:
        rate = {arm: _probe_rate(arm, args.probe_steps, args.limit) for arm in ("mtp", "dflash")}
        cost = rate["mtp"] / rate["dflash"]  # a dflash step in mtp steps
        print(f"probe: mtp {rate['mtp']:.0f} tok/s, dflash {rate['dflash']:.0f} tok/s", flush=True)
    else:
        cost = args.cost
    steps = {"mtp": args.steps, "dflash": max(1, round(args.steps / cost))}
    print(f"a dflash step costs {cost:.3f} mtp steps -> mtp {steps['mtp']} steps, dflash {steps['dflash']}", flush=True)
    recipes = {arm: _recipe(arm, arm, args.limit, max_steps=n, warmup_steps=30) for arm, n in steps.items()}
    for arm, path in recipes.items():
        _train(path, OUT / arm)
    report = OUT / "eval"
    if not (report / "report.json").exists():
        _headstart("eval", str(recipes["dflash"]), "--head", str(OUT / "dflash" / "head-final"), "--head",
                   str(OUT / "mtp" / "head-final"), "--heldout", str(args.heldout), "--k", "3",
                   "--max-tokens", str(args.max_tokens), "--no-baseline", "--batch-size", "1", "--out", str(report),
                   "--no-progress")
    rows = json.loads((report / "report.json").read_text())["runs"]
    by_arm = {row["head_type"]: row for row in rows}
    keys = ("tau", "accept_rate_per_pos", "draft_ms_per_step", "verify_ms_per_step", "tokens_per_s",
            "ar_tokens_per_s", "speedup", "lossless_check")
    print(f"{'':22}{'mtp (AR)':>16}{'dflash':>16}{'dflash / mtp':>14}")
    print(f"{'training steps':22}{steps['mtp']:>16}{steps['dflash']:>16}")
    for key in keys:
        a, b = by_arm["mtp"].get(key), by_arm["dflash"].get(key)
        num = isinstance(a, int | float) and isinstance(b, int | float)
        ratio = f"{b / a:.3f}" if num and a else "-"
        show = [f"{v:.3f}" if isinstance(v, float) else "/".join(f"{x:.2f}" for x in v) if isinstance(v, list)
                else str(v) for v in (a, b)]
        print(f"{key:22}{show[0]:>16}{show[1]:>16}{ratio:>14}")


if __name__ == "__main__":
    main()
