"""A training run's learning curve from its metrics.csv: the engine's held-out tau and top-1 per TTT
step against training tokens, beside the training loss.

    .venv/bin/python benchmarks/learning_curve.py runs/smollm2-135m-mtp assets/heads/smollm2-135m-mtp/learning_curve.png
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path


def read_curve(run_dir: Path) -> tuple[list[dict], list[dict]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "val"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a training output_dir (holds metrics.csv)")
    ap.add_argument("out", type=Path, help="PNG to write")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = read_curve(args.run_dir)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([int(r["tokens"]) / 1e6 for r in train], [float(r["loss"]) for r in train], lw=1)
    a.set_xlabel("training tokens (M)")
    a.set_ylabel("training loss (weighted over TTT steps)")
    a.grid(alpha=0.3)
    toks = [int(r["tokens"]) / 1e6 for r in val]
    b.plot(toks, [float(r["tau"]) for r in val], "o-", label="tau (engine, held-out, greedy)")
    top1 = [json.loads(r["top1_per_step"]) for r in val if r["top1_per_step"]]
    for j in range(len(top1[0]) if top1 else 0):
        b.plot(toks, [1 + t[j] for t in top1], "--", lw=1, label=f"1 + top-1 at TTT step {j + 1}")
    b.set_xlabel("training tokens (M)")
    b.set_ylabel("tau / 1 + top-1")
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"{args.out}: {len(train)} training points, {len(val)} validations; last tau "
          f"{float(val[-1]['tau']):.3f}" if val else f"{args.out}: no validation rows")


if __name__ == "__main__":
    main()
