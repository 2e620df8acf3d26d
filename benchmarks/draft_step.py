"""Decode and chain-step costs on SmolLM2-135M with the row-wise RMSNorm kernel (headstart.kernels,
norm.cpp) against torch's RMSNorm ops (the engine before it), in one run: plain decoding and chain
speculation with a shipped head, batch 1, greedy, the two settings alternating prompt by prompt so
that a change in the machine's load falls on both.

    .venv/bin/python benchmarks/draft_step.py                                  # the EAGLE-3.1 head, k = 1, 3
    .venv/bin/python benchmarks/draft_step.py --head assets/heads/smollm2-135m-mtp --prompts 8

Per setting: tokens/s of plain decoding and of each chain, speculation's speedup, and per step the
milliseconds spent drafting (the head's forwards and choices) and verifying (the target's forward
over k + 1 rows and the acceptance). Greedy output must be identical in both settings' plain and
speculative runs of each setting (checked; the two settings may round a rare row differently).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sharegpt_prompts  # noqa: E402

from headstart.assets import resolve_model  # noqa: E402
from headstart.hardware import describe, resolve_dtype  # noqa: E402
from headstart.heads import load_head  # noqa: E402
from headstart.inference import Engine, SamplingParams  # noqa: E402
from headstart.inference.speculation import SpecConfig, SpecMetrics  # noqa: E402
from headstart.models.llama import load_llama  # noqa: E402
from headstart.nn.norm import RMSNorm  # noqa: E402

HEAD = Path(__file__).resolve().parents[1] / "assets" / "heads" / "smollm2-135m-eagle31"


def set_norm_kernel(modules: list[torch.nn.Module], on: bool) -> None:
    for module in modules:
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.enable_cpu_kernels(on)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=str(HEAD), help="a chain head checkpoint")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", default="1,3", help="chain lengths, comma-separated")
    args = ap.parse_args()
    dtype = resolve_dtype("auto")
    target = load_llama(resolve_model("smollm2-135m"), dtype)
    head = load_head(args.head, target)
    ks = [int(k) for k in args.k.split(",")]
    plain = Engine(target)
    engines = {k: Engine(target, spec=SpecConfig(method="chain", k=k, head=head)) for k in ks}
    prompts = [plain.encode(m) for m in sharegpt_prompts(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    print(f"SmolLM2-135M {dtype} on {describe('cpu')}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"head {Path(args.head).name}; {len(prompts)} ShareGPT prompts x {args.max_tokens} tokens, batch 1, greedy")
    settings = {"torch RMSNorm ops (before)": False, "row-wise RMSNorm kernel": True}
    runs = ["AR"] + [f"chain k={k}" for k in ks]
    seconds = {s: {r: [] for r in runs} for s in settings}
    tokens = {r: 0 for r in runs}
    metrics = {s: {k: SpecMetrics() for k in ks} for s in settings}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    for on in settings.values():  # warm-up (kernel build, first-call costs)
        set_norm_kernel([target, head], on)
        for e in [plain, *engines.values()]:
            e.generate(prompts[:1], SamplingParams(max_tokens=4))
    for i, prompt in enumerate(prompts):
        for name, on in (settings.items() if i % 2 == 0 else reversed(settings.items())):
            set_norm_kernel([target, head], on)
            for run, engine in zip(runs, [plain, *engines.values()]):
                if engine.spec is not None:
                    engine.spec_metrics = SpecMetrics()
                start = time.perf_counter()
                out = engine.generate([prompt], params)[0]
                seconds[name][run].append(time.perf_counter() - start)
                outputs.setdefault((name, run), []).append(out.token_ids)
                if name == next(iter(settings)):
                    tokens[run] += len(out.token_ids)
                if engine.spec is not None:
                    metrics[name][engine.spec.k].merge(engine.spec_metrics)
    same = all(outputs[(n, r)] == outputs[(n, "AR")] for n in settings for r in runs)
    print(f"\n{'setting':<28} {'run':<10} {'tok/s':>7} {'vs AR':>7} {'tau':>6} {'draft ms/step':>14} "
          f"{'verify ms/step':>15}")
    rates: dict[str, dict[str, float]] = {}
    for name in settings:
        rates[name] = {r: tokens[r] / sum(seconds[name][r]) for r in runs}
        for r in runs:
            line = f"{name:<28} {r:<10} {rates[name][r]:>7.1f} {rates[name][r] / rates[name]['AR']:>6.2f}x"
            if r != "AR":
                m = metrics[name][int(r.split("=")[1])]
                s = m.summary()
                line += (f" {s['tau']:>6.3f} {1000 * m.draft_seconds / m.steps:>14.2f} "
                         f"{1000 * m.verify_seconds / m.steps:>15.2f}")
            print(line)
    before, after = settings
    print("\nkernel / torch ops, tokens/s: " + ", ".join(
        f"{r} {rates[after][r] / rates[before][r]:.3f}x" for r in runs))
    per_prompt = [b / a for b, a in zip(seconds[before]["AR"], seconds[after]["AR"])]
    print(f"AR per prompt (torch ops time / kernel time): median {statistics.median(per_prompt):.3f}, "
          f"range {min(per_prompt):.3f}..{max(per_prompt):.3f}")
    print(f"greedy speculative output identical to greedy AR output in each setting: {same}")
    if not same:
        raise SystemExit("greedy outputs differ: speculation or the kernel is not lossless here")


if __name__ == "__main__":
    main()
