"""`headstart regenerate` with our engine vs with vLLM (`--engine vllm`) on the same conversations, same
batch, same sampling, in one run: conversations/s and generated tokens/s of each, with the ratio, and
how many regenerated answers are identical (greedy).

    .venv/bin/python benchmarks/regenerate.py                       # 48 ShareGPT first turns, batch 16
    .venv/bin/python benchmarks/regenerate.py --limit 96 --batch 32 --max-tokens 256

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


def run(engine: str, args: argparse.Namespace, out: Path) -> tuple[float, list[dict]]:
    recipe = out / f"{engine}.yaml"
    recipe.write_text(f"output_dir: {out / engine}\ntarget:\n  model: smollm2-135m\n  dtype: auto\n"
                      f"data:\n  source: sharegpt\nregenerate:\n  limit: {args.limit}\n  max_turns: 1\n"
                      f"  max_prompt_tokens: 384\n  max_tokens: {args.max_tokens}\n  batch_size: {args.batch}\n"
                      f"  temperature: 0.0\n  engine: {engine}\n")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "headstart.cli", "regenerate", str(recipe)], check=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / engine / "regenerated.jsonl").read_text().splitlines()]
    return seconds, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=48, help="ShareGPT rows read (first turns regenerated)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default="runs/bench-regenerate")
    args = p.parse_args()
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    from common import cpu_name

    got = {e: run(e, args, out) for e in ("headstart", "vllm")}
    from transformers import AutoTokenizer

    from headstart.assets import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))

    def tokens(rows: list[dict]) -> int:
        return sum(len(tok(t["value"])["input_ids"]) for r in rows for t in r["conversations"] if t["from"] == "gpt")

    print(f"CPU: {cpu_name()}; {args.limit} ShareGPT rows, first turns, batch {args.batch}, up to {args.max_tokens} "
          "tokens, greedy\n")
    print("| engine | conversations | seconds (start-up included) | conv/s | answer tokens/s |")
    print("|---|---|---|---|---|")
    rate = {}
    for e, (sec, rows) in got.items():
        rate[e] = len(rows) / sec
        print(f"| {e} | {len(rows)} | {sec:.1f} | {rate[e]:.2f} | {tokens(rows) / sec:.1f} |")
    same = sum(a["conversations"] == b["conversations"] for a, b in zip(got["headstart"][1], got["vllm"][1]))
    print(f"\nours / vLLM (conv/s): {rate['headstart'] / rate['vllm']:.2f}x; identical answers: {same} of "
          f"{len(got['vllm'][1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
