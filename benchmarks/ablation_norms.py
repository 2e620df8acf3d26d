"""The norm-placement ablation: `mtp` (RMSNorm restored) vs `eagle1` (no norms), same data, steps and
seed on this CPU. Trains both (unless --report-only) and writes benchmarks/ablation_norms.md and
benchmarks/ablation_norms.png from the two runs' metrics.csv / metrics.json.

    .venv/bin/python benchmarks/ablation_norms.py                 # ~25 min on a 2-core CPU
    .venv/bin/python benchmarks/ablation_norms.py --report-only   # tables and plot from finished runs
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["train.max_steps=60", "train.batch_tokens=2048", "train.val_every_steps=30", "train.val_prompts=16",
            "train.val_max_tokens=48", "train.warmup_steps=5", "train.ckpt_every_steps=20", "train.ttt_steps=1",
            "logging.wandb=false", "logging.every_steps=5"]


# arm -> (recipe, extra overrides): eagle1 as the recipes build it (last target layer copied, like
# mtp), and eagle1 from a random layer as the original EAGLE trained it.
ARMS = {"mtp": ("mtp", []), "eagle1": ("eagle1", []), "eagle1-scratch": ("eagle1", ["head.init_from_target=false"])}


def run_dir(arm: str) -> Path:
    return ROOT / "runs" / f"ablation-{arm}"


def train(arm: str) -> None:
    recipe, extra = ARMS[arm]
    cmd = [sys.executable, "-m", "headstart.cli", "train", f"recipes/smollm2-135m-{recipe}.yaml", "--no-progress",
           "--set", f"output_dir={run_dir(arm)}"]
    for s in SETTINGS + extra:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=ROOT, check=True)


def curve(kind: str) -> list[dict[str, str]]:
    with open(run_dir(kind) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def report(cpu: str) -> str:
    runs = {k: json.loads((run_dir(k) / "metrics.json").read_text())
            for k in ARMS if (run_dir(k) / "metrics.json").exists()}
    lines = [
        "# Norm placement: `mtp` (RMSNorm restored) vs `eagle1`, SmolLM2-135M, same data, steps and seed",
        "",
        f"Run on this project's 2-core CPU ({cpu}) by `benchmarks/ablation_norms.py`: three arms from",
        "`recipes/smollm2-135m-{mtp,eagle1}.yaml` with `" + " ".join(f"--set {s}" for s in SETTINGS) + "`;",
        "`eagle1` starts like `mtp` from the target's last layer (the recipes' `head.init_from_target: true`),",
        "`eagle1-scratch` adds `--set head.init_from_target=false` (a random layer, as the original EAGLE).",
        "4,000 ShareGPT rows, online target, bf16-mixed. Validation = the engine, greedy, k = 3 drafts,",
        "16 held-out first user turns, 48 new tokens each; top-1 / expected acceptance on held-out batches.",
        "",
        "| head | step | tokens | val_loss | top-1 (step 0) | sampled accept (step 0) | engine tau (k=3) | alpha "
        "| accept_rate_per_pos |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, m in runs.items():
        rate = ", ".join(f"{x:.2f}" for x in m.get("accept_rate_per_pos") or [])
        sampled = m.get("sampled_accept_per_step", m.get("expected_accept_per_step"))  # the older name too
        lines.append(f"| `{kind}` | {m['step']} | {m['tokens']:,} | {m['val_loss']:.3f} | "
                     f"{m['top1_per_step'][0]:.3f} | {sampled[0]:.3f} | {m['tau']:.3f} | "
                     f"{m['alpha']:.3f} | [{rate}] |")
    lines += ["", "Validation during training (engine tau and held-out top-1):", "",
              "| head | step | val_loss | top-1 | tau |", "|---|---|---|---|---|"]
    for kind in runs:
        for r in curve(kind):
            if r["kind"] == "val":
                lines.append(f"| `{kind}` | {r['step']} | {float(r['val_loss']):.3f} | "
                             f"{json.loads(r['top1_per_step'])[0]:.3f} | {float(r['tau']):.3f} |")
    lines += ["", "![learning curves](ablation_norms.png)", ""]
    return "\n".join(lines)


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in ARMS:
        if not (run_dir(kind) / "metrics.csv").exists():
            continue
        rows = curve(kind)
        train = [r for r in rows if r["kind"] == "train"]
        val = [r for r in rows if r["kind"] == "val"]
        a.plot([int(r["step"]) for r in train], [float(r["loss"]) for r in train], label=kind)
        b.plot([int(r["step"]) for r in val], [float(r["tau"]) for r in val], marker="o", label=kind)
    a.set(xlabel="step", ylabel="training loss (KL + feature)", title="training loss", yscale="log")
    b.set(xlabel="step", ylabel="engine tau (k=3, greedy)", title="validation: engine tau")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(ROOT / "benchmarks" / "ablation_norms.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if not args.report_only:
        for arm in ARMS:
            train(arm)
    from headstart.hardware import describe

    md = ROOT / "benchmarks" / "ablation_norms.md"
    old = md.read_text() if md.exists() else ""
    reading = old[old.index("\n## Reading"):] if "\n## Reading" in old else ""  # hand-written, kept
    md.write_text(report(describe("cpu")) + reading)
    plot()
    print((ROOT / "benchmarks" / "ablation_norms.md").read_text())


if __name__ == "__main__":
    main()
