"""Self-distillation ablation at equal training tokens: the same conversations' first user turns
with ShareGPT's own answers, or with the target's regenerated answers (`headstart regenerate`), one
mtp head trained on each with the same recipe, seed and step count, then the engine's acceptance on
the same held-out prompts (the first user turns of the held-out conversations, decoded greedily by
the target: what the head will meet when it serves).

    .venv/bin/python benchmarks/regeneration_ablation.py                  # 120 steps each, ttt 1
    .venv/bin/python benchmarks/regeneration_ablation.py --steps 300 --ttt 3

It reads the shipped recipe (recipes/smollm2-135m-mtp.yaml) and its regenerated conversations; run
`headstart regenerate recipes/smollm2-135m-mtp.yaml` first. Everything else lands under
runs/ablation-regeneration/ (each stage resumes: rerunning skips what is done).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from headstart.assets import resolve_data
from headstart.data.sources import read_conversations
from headstart.fileio import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-mtp.yaml"
OUT = ROOT / "runs" / "ablation-regeneration"


def sharegpt_answers(regenerated: Path, dest: Path) -> int:
    """The regenerated file's conversations (same ids, same first user turn) with ShareGPT's first
    answer instead of the target's."""
    lines = regenerated.read_text(encoding="utf-8").split("\n")  # not splitlines(): U+2028 occurs in JSON strings
    ids = [json.loads(line)["id"] for line in lines if line.strip()]
    wanted = set(ids)
    rows = {}
    for conv in read_conversations(resolve_data("sharegpt")).conversations:
        if conv["id"] in wanted and conv["id"] not in rows:
            msgs = conv["messages"]
            first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
            if first is not None:
                rows[conv["id"]] = {"id": conv["id"], "messages": msgs[:first + 1]}
    missing = [i for i in ids if i not in rows]
    if missing:
        raise SystemExit(f"{len(missing)} regenerated ids are not in ShareGPT (first: {missing[0]})")
    atomic_write_text(dest, "".join(json.dumps(rows[i], ensure_ascii=False) + "\n" for i in ids))
    return len(ids)


def arm_recipe(base: dict, name: str, source: Path, args: argparse.Namespace, shards: Path | None) -> Path:
    r = json.loads(json.dumps(base))
    r.pop("regenerate", None)
    r["name"] = f"ablation-{name}"
    r["output_dir"] = str(OUT / name)
    r["data"]["source"] = str(source)
    r["train"].update(max_steps=args.steps, ttt_steps=args.ttt, warmup_steps=min(30, args.steps // 10),
                      val_every_steps=0, val_prompts=args.prompts, val_max_tokens=args.max_tokens,
                      ckpt_every_steps=max(10, args.steps // 4))
    if shards is not None:  # the same data, precomputed with the same section: read, not recomputed
        r["train"]["shards_dir"] = str(shards)
    r["logging"]["wandb"] = False
    path = OUT / f"{name}.yaml"
    atomic_write_text(path, yaml.safe_dump(r, sort_keys=False))
    return path


def run(verb: str, recipe: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "headstart.cli", verb, str(recipe), *extra]
    print("+ headstart", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps per arm (x batch_tokens = tokens)")
    ap.add_argument("--ttt", type=int, default=1, help="ttt_steps of both arms")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for the engine's acceptance")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per held-out prompt")
    args = ap.parse_args()
    base = yaml.safe_load(RECIPE.read_text())
    regenerated = ROOT / base["data"]["source"]
    if not regenerated.is_file():
        raise SystemExit(f"{regenerated} not found: run `headstart regenerate {RECIPE.relative_to(ROOT)}` first")
    OUT.mkdir(parents=True, exist_ok=True)
    answers = OUT / "sharegpt-answers.jsonl"
    if not answers.exists():
        print(f"{sharegpt_answers(regenerated, answers):,} conversations with ShareGPT's answers -> {answers}")
    results = {}
    for name, source in (("sharegpt", answers), ("regenerated", regenerated)):
        shipped = ROOT / base["output_dir"] / "precompute"
        reuse = name == "regenerated" and (shipped / "manifest.json").exists()  # the shipped run's own shards
        recipe = arm_recipe(base, name, source, args, shards=shipped if reuse else None)
        arm = OUT / name
        shards = shipped if reuse else arm / "precompute"
        if not (shards / "manifest.json").exists():
            run("precompute", recipe, *(["--resume"] if shards.exists() else []))
        if not (arm / "head-final").exists():
            run("train", recipe, *(["--resume"] if (arm / "checkpoints" / "last.ckpt").exists() else []))
        manifest = json.loads((shards / "manifest.json").read_text())
        metrics = json.loads((arm / "metrics.json").read_text())
        results[name] = {"tokens_seen": metrics.get("tokens"), "shard_tokens": manifest.get("tokens"),
                         "tau": metrics.get("tau"), "accept_rate_per_pos": metrics.get("accept_rate_per_pos"),
                         "val_loss": metrics.get("val_loss"), "top1_per_step": metrics.get("top1_per_step")}
    a, b = results["sharegpt"], results["regenerated"]
    print(f"\nregeneration ablation: {args.steps} steps, ttt {args.ttt}, {args.prompts} held-out prompts x "
          f"{args.max_tokens} tokens, greedy k = {base['head']['k']}")
    print(f"{'':24}{'ShareGPT answers':>18}{'regenerated':>14}{'ratio':>8}")
    for key, label in (("tokens_seen", "training tokens"), ("shard_tokens", "tokens available"),
                       ("tau", "tau (engine)"), ("val_loss", "held-out loss")):
        x, y = a[key], b[key]
        ratio = f"{y / x:.2f}" if isinstance(x, (int, float)) and x else ""
        fmt = (lambda v: f"{v:,}") if key.endswith("tokens") or key == "tokens_seen" else (lambda v: f"{v:.3f}")
        print(f"{label:24}{fmt(x):>18}{fmt(y):>14}{ratio:>8}")
    rate = lambda r: "/".join(f"{v:.2f}" for v in r["accept_rate_per_pos"] or [])  # noqa: E731
    print(f"{'accept rate per pos':24}{rate(a):>18} {rate(b):>13}")
    print("(held-out loss is each arm's own held-out split: ShareGPT answers vs the target's own; not comparable)")
    atomic_write_text(OUT / "results.json", json.dumps({"args": vars(args), **results}, indent=2))


if __name__ == "__main__":
    main()
