"""Training runs side by side at their common validation steps: the engine's held-out tau and acceptance per
position of each run (its metrics.csv), the difference to the first run, and what the runs' recipes differ in
(their train.json), so that an A/B states its one changed key — or shows that it changed more than one.

    .venv/bin/python benchmarks/compare_runs.py kl=runs/scaling/tokens-4400-v8-p64x128 \\
        lk=runs/scaling/tokens-4400-v8-p64x128-lk

The last row of each run also carries tau's standard error from its final validation's accepted-drafts
histogram (metrics.json): a difference under ~2 of them is noise.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

from common import cpu_name

IGNORED = {"name", "output_dir", "train.shards_dir"}  # differ between any two runs without changing what is trained


def val_rows(run: Path) -> dict[int, dict]:
    """step -> the run's validation row (tau, tokens, acceptance per position)."""
    try:
        with open(run / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["kind"] == "val"]
    except FileNotFoundError:
        raise SystemExit(f"{run}: no metrics.csv (not a training run's output directory?)") from None
    if not rows:
        raise SystemExit(f"{run}: no validation row in metrics.csv yet")
    return {int(r["step"]): {"tokens": int(r["tokens"]), "tau": float(r["tau"]),
                             "accept": json.loads(r["accept_rate_per_pos"])} for r in rows}


def tau_se(run: Path) -> float | None:
    """tau's standard error at the run's last validation (draft steps taken as independent)."""
    try:
        hist = json.loads((run / "metrics.json").read_text())["accept_histogram"]
    except (OSError, KeyError, ValueError):
        return None
    n = sum(hist)
    if not n:
        return None
    mean = sum(i * c for i, c in enumerate(hist)) / n
    return math.sqrt(sum(c * (i - mean) ** 2 for i, c in enumerate(hist)) / n / n)


def recipe_differences(runs: list[Path]) -> list[str]:
    """'key: a -> b' for every flat recipe key (train.json) on which a run differs from the first."""
    flats = []
    for run in runs:
        try:
            flats.append(json.loads((run / "train.json").read_text())["recipe"])
        except (OSError, KeyError, ValueError):
            raise SystemExit(f"{run}: no readable train.json (what the run was trained with)") from None
    out = []
    for run, flat in zip(runs[1:], flats[1:]):
        for key in sorted(set(flats[0]) | set(flat)):
            if key not in IGNORED and flats[0].get(key) != flat.get(key):
                out.append(f"{run.name}: {key}: {flats[0].get(key)!r} -> {flat.get(key)!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="[LABEL=]RUN_DIR", help="training output directories (the first is "
                                                                        "the baseline)")
    args = ap.parse_args()
    if len(args.runs) < 2:
        raise SystemExit("give at least two runs")
    labels, runs = [], []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        labels.append(label if sep else Path(spec).name)
        runs.append(Path(path if sep else spec))
    rows = [val_rows(r) for r in runs]
    steps = sorted(set.intersection(*(set(r) for r in rows)))
    if not steps:
        raise SystemExit("the runs share no validation step")
    print(f"{cpu_name()}; runs: " + ", ".join(f"{a} = {r}" for a, r in zip(labels, runs)))
    diffs = recipe_differences(runs)
    print("recipes differ in: " + ("; ".join(diffs) if diffs else "nothing (the same recipe)") + "\n")
    head = " | ".join(f"tau {a}" for a in labels) + " | " + " | ".join(f"Δ {a}" for a in labels[1:]) + " | " + \
        " | ".join(f"accept per position {a}" for a in labels)
    print(f"| step | training tokens | {head} |")
    print("|---" * (2 + 2 * len(labels) + len(labels) - 1) + "|")
    ses = [tau_se(r) for r in runs]
    for step in steps:
        last = step == steps[-1] and all(max(r) == step for r in rows)
        taus = [f"{r[step]['tau']:.3f}" + (f" ± {se:.3f}" if last and se is not None else "")
                for r, se in zip(rows, ses)]
        deltas = [f"{r[step]['tau'] - rows[0][step]['tau']:+.3f}" for r in rows[1:]]
        accepts = [" / ".join(f"{a:.2f}" for a in r[step]["accept"]) for r in rows]
        print(f"| {step} | {rows[0][step]['tokens']:,} | " + " | ".join(taus + deltas + accepts) + " |")


if __name__ == "__main__":
    main()
