"""Training-time test (TTT) at equal CPU time, and the learning rate for that budget: mtp heads trained
from the same shards with ttt_steps 1 or 3, each arm given the steps its step cost buys in the same
CPU time, then the engine's acceptance on the same held-out prompts (greedy, k = the recipe's).

A TTT-3 step costs `--ratio` TTT-1 steps (benchmarks/train.md measures it: 3,254 vs 909 tokens/s on a
2-core Xeon with AMX, 3.58x), so at equal CPU time TTT 1 sees `ratio` times the tokens; TTT 3 teaches
the head to read its own drafts (positions 2 and 3). Steps, not wall-clock limits, set each arm's
budget, so a loaded machine slows the arms without changing what they learn.

    .venv/bin/python benchmarks/ttt_budget.py --shards runs/smollm2-135m-mtp/precompute \\
        --source runs/smollm2-135m-mtp/regenerated.jsonl --ttt3-steps 110 --arms 3:2e-3,1:2e-3,1:4e-3

It reads the shipped recipe (recipes/smollm2-135m-mtp.yaml) for everything else; the arms land under
runs/ttt-budget/ (each resumes: rerunning skips what is done).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml
from common import arm_result, print_arms

from headstart.fileio import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-mtp.yaml"
OUT = ROOT / "runs" / "ttt-budget"


def arm_recipe(base: dict, name: str, ttt: int, lr: float, steps: int, args: argparse.Namespace) -> Path:
    r = json.loads(json.dumps(base))
    r.pop("regenerate", None)
    r["name"] = f"ttt-budget-{name}"
    r["output_dir"] = str(OUT / name)
    r["data"]["source"] = str(Path(args.source).resolve())
    r["train"].update(max_steps=steps, ttt_steps=ttt, lr=lr, warmup_steps=min(30, steps // 10), val_every_steps=0,
                      val_prompts=args.prompts, val_max_tokens=args.max_tokens, ckpt_every_steps=max(10, steps // 4),
                      shards_dir=str(Path(args.shards).resolve()))
    r["logging"]["wandb"] = False
    path = OUT / f"{name}.yaml"
    atomic_write_text(path, yaml.safe_dump(r, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", required=True, help="a precompute directory of the recipe's target")
    ap.add_argument("--source", required=True, help="the conversations the shards were made from (held-out prompts)")
    ap.add_argument("--ttt3-steps", type=int, default=110, help="steps of a TTT-3 arm; TTT-1 arms get ratio x as many")
    ap.add_argument("--ratio", type=float, default=3.58, help="a TTT-3 step in TTT-1 steps (train.md)")
    ap.add_argument("--arms", default="3:2e-3,1:2e-3", help="ttt_steps:lr pairs")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for the engine's acceptance")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per held-out prompt")
    args = ap.parse_args()
    base = yaml.safe_load(RECIPE.read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for spec in args.arms.split(","):
        ttt, lr = int(spec.split(":")[0]), float(spec.split(":")[1])
        if ttt not in (1, 3):
            raise SystemExit(f"arm {spec}: --ratio prices TTT 1 against TTT 3 only")
        steps = args.ttt3_steps if ttt == 3 else round(args.ttt3_steps * args.ratio)
        name = f"ttt{ttt}-lr{lr:g}-{steps}"
        recipe = arm_recipe(base, name, ttt, lr, steps, args)
        arm = OUT / name
        if not (arm / "head-final").exists():
            cmd = [sys.executable, "-m", "headstart.cli", "train", str(recipe)]
            if (arm / "checkpoints" / "last.ckpt").exists():
                cmd.append("--resume")
            print("+ headstart", " ".join(cmd[3:]), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT)
        results[name] = arm_result(arm, ttt=ttt, lr=lr, steps=steps)
    print(f"\nTTT at equal CPU time: a TTT-3 step = {args.ratio} TTT-1 steps; {args.prompts} held-out prompts x "
          f"{args.max_tokens} tokens, greedy k = {base['head']['k']}")
    print_arms(results)
    atomic_write_text(OUT / "results.json", json.dumps({"args": vars(args), **results}, indent=2))


if __name__ == "__main__":
    main()
