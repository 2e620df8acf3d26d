"""`headstart regenerate` with our engine (with and without its prefix cache) vs with vLLM (`--engine vllm`)
on the same conversations, same batch, same sampling, in one run: conversations/s and generated tokens/s of
each, with the ratio to the first arm, and how many regenerated conversations are identical (greedy).

    .venv/bin/python benchmarks/regenerate.py                       # 48 ShareGPT first turns, batch 16
    .venv/bin/python benchmarks/regenerate.py --limit 96 --batch 32 --max-tokens 256
    .venv/bin/python benchmarks/regenerate.py --max-turns 0 --arms headstart,headstart-no-prefix-cache  # every turn

Both runs write under --out (a fresh directory per run). Each time is the whole command, start-up included
(vLLM's ~20 s here, which a regeneration of thousands of conversations amortises): run enough rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


ARMS = {"headstart": ("headstart", True), "headstart-no-prefix-cache": ("headstart", False), "vllm": ("vllm", True)}


def run(arm: str, args: argparse.Namespace, out: Path) -> tuple[float, list[dict]]:
    engine, prefix_cache = ARMS[arm]
    recipe = out / f"{arm}.yaml"
    turns = args.max_turns or "null"
    recipe.write_text(f"output_dir: {out / arm}\ntarget:\n  model: smollm2-135m\n  dtype: auto\n"
                      f"data:\n  source: sharegpt\nregenerate:\n  limit: {args.limit}\n  max_turns: {turns}\n"
                      f"  max_prompt_tokens: 384\n  max_context_tokens: 1024\n  max_tokens: {args.max_tokens}\n"
                      f"  batch_size: {args.batch}\n  temperature: 0.0\n  engine: {engine}\n"
                      f"  prefix_cache: {str(prefix_cache).lower()}\n")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "headstart.cli", "regenerate", str(recipe)], check=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / arm / "regenerated.jsonl").read_text().splitlines()]
    return seconds, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=48, help="ShareGPT rows read (first turns regenerated)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-turns", type=int, default=1, help="assistant turns per conversation (0: every turn)")
    p.add_argument("--arms", default="headstart,vllm",
                   help=f"comma-separated, the first is the reference: {list(ARMS)}")
    p.add_argument("--out", default="runs/bench-regenerate")
    args = p.parse_args()
    arms = args.arms.split(",")
    if not arms or any(a not in ARMS for a in arms):
        p.error(f"--arms: each of {list(ARMS)}, got {args.arms}")
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    from common import cpu_name

    got = {a: run(a, args, out) for a in arms}
    from transformers import AutoTokenizer

    from headstart.assets import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))

    def tokens(rows: list[dict]) -> int:
        return sum(len(tok(t["value"])["input_ids"]) for r in rows for t in r["conversations"] if t["from"] == "gpt")

    turns = "every turn" if not args.max_turns else f"up to {args.max_turns} turn(s)"
    print(f"CPU: {cpu_name()}; {args.limit} ShareGPT rows, {turns}, batch {args.batch}, up to {args.max_tokens} "
          "tokens, greedy\n")
    print("| arm | conversations | turns | seconds (start-up included) | conv/s | answer tokens/s | "
          f"conv/s vs {arms[0]} | identical conversations to {arms[0]} |")
    print("|---|---|---|---|---|---|---|---|")
    ref_sec, ref_rows = got[arms[0]]
    for a, (sec, rows) in got.items():
        n_turns = sum(len(r["regenerated"]["finish_reasons"]) for r in rows)
        same = sum(x["conversations"] == y["conversations"] for x, y in zip(ref_rows, rows))
        print(f"| {a} | {len(rows)} | {n_turns} | {sec:.1f} | {len(rows) / sec:.2f} | {tokens(rows) / sec:.1f} | "
              f"{(len(rows) / sec) / (len(ref_rows) / ref_sec):.2f}x | {same} of {len(rows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
