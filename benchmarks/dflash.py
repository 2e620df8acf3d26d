"""DFlash (block-parallel drafting) against the best autoregressive head at equal training CPU time,
measured in one run with the engine on the same held-out prompts: tau, draft time per step and the
speedup over plain decoding of each, side by side with their ratio.

The arms are the repository's recipes with only the data and the budget changed:
- `dflash`: recipes/smollm2-135m-dflash.yaml (2 layers, block 4 = 3 drafts per forward, lr 4e-3);
- `mtp`: recipes/smollm2-135m-mtp.yaml at lr 4e-3, the best arm of benchmarks/head_budget.md.
Both train online (the target runs every step) on the first --limit embedded ShareGPT conversations,
for the steps their measured step cost buys in the same CPU time (`--cost dflash=X`: a dflash step in
mtp steps; benchmarks/dflash.md gives the probe). Steps, not a clock, set each budget, so a loaded
machine slows an arm without changing what it learns. `headstart eval` then runs both heads and plain
decoding together (greedy, k = 3).

    .venv/bin/python benchmarks/dflash.py --steps 120 --cost dflash=1.0

Everything lands under runs/dflash-bench/ and resumes: rerunning skips the finished arms.
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


def _recipe(arm: str, steps: int, limit: int) -> Path:
    r = yaml.safe_load((ROOT / "recipes" / f"smollm2-135m-{arm}.yaml").read_text())
    r.pop("regenerate", None)
    r["name"] = f"dflash-bench-{arm}"
    r["output_dir"] = str(OUT / arm)
    r["data"].update(source="sharegpt", limit=limit, max_length=512, split_key="id_prefix")
    r["train"].update(source="online", max_steps=steps, lr=0.004, warmup_steps=min(30, steps // 4),
                      val_every_steps=0, ckpt_every_steps=20)
    r["logging"]["wandb"] = False
    path = OUT / f"{arm}.yaml"
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(r, sort_keys=False))
    return path


def _headstart(*args: str) -> None:
    print("+ headstart", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "headstart.cli", *args], check=True, cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120, help="steps of the mtp arm (dflash: steps / cost)")
    ap.add_argument("--cost", default="dflash=1.0", help="dflash=X: a dflash step in mtp steps")
    ap.add_argument("--limit", type=int, default=3000, help="ShareGPT conversations to train on")
    ap.add_argument("--heldout", type=int, default=16, help="held-out prompts for the engine's figures")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    cost = float(args.cost.split("=", 1)[1])
    steps = {"mtp": args.steps, "dflash": max(1, round(args.steps / cost))}
    recipes = {arm: _recipe(arm, n, args.limit) for arm, n in steps.items()}
    for arm, path in recipes.items():
        if (OUT / arm / "head-final" / "config.json").exists():
            print(f"{arm}: trained already (runs/dflash-bench/{arm}/head-final)")
            continue
        resume = ["--resume"] if (OUT / arm / "checkpoints" / "last.ckpt").exists() else []
        _headstart("train", str(path), "--no-progress", *resume)
    report = OUT / "eval"
    if not (report / "report.json").exists():
        _headstart("eval", str(recipes["dflash"]), "--head", str(OUT / "dflash" / "head-final"), "--head",
                   str(OUT / "mtp" / "head-final"), "--heldout", str(args.heldout), "--k", "3",
                   "--max-tokens", str(args.max_tokens), "--no-baseline", "--batch-size", "1", "--out", str(report),
                   "--no-progress")
    rows = json.loads((report / "report.json").read_text())["rows"]
    by_arm = {}
    for row in rows:
        name = "dflash" if "dflash" in str(row.get("head", "")) else "mtp"
        by_arm[name] = row
    keys = ("tau", "accept_rate_per_pos", "draft_ms_per_step", "verify_ms_per_step", "tokens_per_s",
            "ar_tokens_per_s", "speedup", "lossless_check")
    print(f"{'':22}{'mtp (AR)':>12}{'dflash':>12}{'dflash / mtp':>14}")
    print(f"{'training steps':22}{steps['mtp']:>12}{steps['dflash']:>12}")
    for key in keys:
        a, b = by_arm["mtp"].get(key), by_arm["dflash"].get(key)
        num = isinstance(a, int | float) and isinstance(b, int | float)
        ratio = f"{b / a:.3f}" if num and a else "-"
        show = [f"{v:.3f}" if isinstance(v, float) else "/".join(f"{x:.2f}" for x in v) if isinstance(v, list)
                else str(v) for v in (a, b)]
        print(f"{key:22}{show[0]:>12}{show[1]:>12}{ratio:>14}")


if __name__ == "__main__":
    main()
