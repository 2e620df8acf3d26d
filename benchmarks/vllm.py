"""Our engine vs vLLM on this CPU, in one run: `headstart eval --engine headstart,vllm` at each batch
size over the same prompts, each engine alternating its plain and speculative runs group by group,
then one table side by side: plain tokens/s and the ratio, and per shipped head and k the tau,
acceptance per position, speculative tokens/s and speedup of each engine.

    .venv/bin/python benchmarks/vllm.py                                   # batch 1 and 4, k = 1..3
    .venv/bin/python benchmarks/vllm.py --batch 1 --k 3 --prompts benchmarks/prompts/code_docs.jsonl

Heads vLLM does not serve (the mtp head on a Llama target) get our rows only, with vLLM's reason.
Reports stay under --out (one eval report per batch size); the table is printed and written as
table.md there. Both engines use both cores (vLLM's default reserves one: --vllm-threads default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_name  # noqa: E402

HEADS = ["assets/heads/smollm2-135m-eagle31", "assets/heads/smollm2-135m-mtp"]


def run_eval(batch: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "headstart.cli", "eval", args.recipe, *sum((["--head", h] for h in args.head), []),
           "--k", args.k, "--batch-size", str(batch), "--max-tokens", str(args.max_tokens), "--engine",
           "headstart,vllm", "--vllm-threads", args.vllm_threads, "--no-baseline", "--no-progress",
           "--out", str(out / f"batch{batch}")]
    cmd += ["--prompts", args.prompts] if args.prompts else ["--heldout", str(args.heldout)]
    print("$ " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads((out / f"batch{batch}" / "report.json").read_text())


def table(reports: dict[int, dict]) -> list[str]:
    lines = ["| batch | head | k | tau ours | tau vLLM | vLLM - ours | accept/pos ours | accept/pos vLLM | "
             "spec tok/s ours | spec tok/s vLLM | speedup ours | speedup vLLM | lossless ours / vLLM (fp32) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = ["| batch | plain tok/s ours | plain tok/s vLLM | ours / vLLM |", "|---|---|---|---|"]
    for b, rep in reports.items():
        ours_ar = next(iter(rep["ar"].values()))["tokens_per_s"]
        v_ar = next(iter(rep.get("vllm", {}).get("ar", {}).values()), {}).get("tokens_per_s")
        plain.append(f"| {b} | {ours_ar:.1f} | {v_ar:.1f} | {ours_ar / v_ar:.2f}x |" if v_ar else
                     f"| {b} | {ours_ar:.1f} | - | - |")
        ours = {(r["label"], r["k"]): r for r in rep["runs"] if r.get("engine", "headstart") == "headstart"}
        theirs = {(r["label"], r["k"]): r for r in rep["runs"] if r.get("engine") == "vllm"}
        for key, o in sorted(ours.items()):
            v = theirs.get(key)
            pos = lambda r: " ".join(f"{x:.2f}" for x in r["accept_rate_per_pos"])  # noqa: E731
            lines.append(
                f"| {b} | {key[0]} | {key[1]} | {o['tau']:.3f} | " + (f"{v['tau']:.3f} | {v['tau'] - o['tau']:+.3f} | "
                if v else "- | - | ") + f"{pos(o)} | " + (f"{pos(v)} | " if v else "- | ")
                + f"{o['tokens_per_s']:.1f} | " + (f"{v['tokens_per_s']:.1f} | " if v else "- | ")
                + f"{o['speedup']:.2f}x | " + (f"{v['speedup']:.2f}x | " if v else "not served | ")
                + f"{o.get('lossless_check', '-')} / " + (v.get("lossless_check", "-") if v else "-") + " |")
    return plain + [""] + lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/smollm2-135m-eagle31.yaml")
    p.add_argument("--head", action="append", default=None, help="head directories (default: both shipped heads)")
    p.add_argument("--prompts", default="benchmarks/prompts/code_docs.jsonl",
                   help="JSONL prompts (default: the 24 code / docs prompts); '' for ShareGPT held-out")
    p.add_argument("--heldout", type=int, default=16)
    p.add_argument("--batch", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--k", default="1,2,3")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vllm-threads", choices=["all", "default"], default="all")
    p.add_argument("--out", default="runs/bench-vllm")
    args = p.parse_args()
    args.head = args.head or HEADS
    out = Path(args.out)
    reports = {b: run_eval(b, args, out) for b in (int(x) for x in args.batch.split(","))}
    rep = next(iter(reports.values()))
    head = [f"CPU: {cpu_name()}, {rep['settings']['threads']} threads, target {rep['settings'].get('dtype')}; "
            f"vLLM {rep.get('vllm', {}).get('version', '?')} (threads: {args.vllm_threads}); "
            f"{rep['prompts']} prompts, {rep['max_tokens']} new tokens, greedy", ""]
    text = "\n".join(head + table(reports)) + "\n"
    print(text)
    (out / "table.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
