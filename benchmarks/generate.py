"""Our engine vs Hugging Face `generate` on the same prompts, same dtype, same run.

    .venv/bin/python benchmarks/generate.py            # bf16 + fp32, batch 1 + 8, 128 new tokens, 8 prompts
    .venv/bin/python benchmarks/generate.py --quick    # 4 prompts, 64 tokens

Both sides generate exactly --max-tokens tokens per prompt (EOS ignored), greedy. Batch 1 runs the
prompts one after another; batch B gives both sides B prompts at once (HF with left padding).
Prints tokens/s for both and the ratio, and checks that greedy outputs agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sharegpt_prompts, timed  # noqa: E402

from headstart.assets import resolve_model  # noqa: E402
from headstart.inference import Engine, SamplingParams  # noqa: E402
from headstart.models.llama import DTYPES  # noqa: E402


def hf_generate(model, tok, prompts: list[list[int]], batch: int, max_tokens: int) -> list[list[int]]:
    outs = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        outs.extend(gen[:, width:].tolist())
    return outs


def ours_generate(engine: Engine, prompts: list[list[int]], batch: int, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs = []
    for i in range(0, len(prompts), batch):
        outs.extend(o.token_ids for o in engine.generate(prompts[i:i + batch], params))
    return outs


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 64 tokens")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens = 4, 64
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model_dir = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    messages = sharegpt_prompts(args.prompts)
    print(f"SmolLM2-135M, {len(messages)} ShareGPT prompts, {args.max_tokens} new tokens each, greedy, "
          f"{torch.get_num_threads()} threads")
    print(f"{'dtype':<6} {'batch':>5} {'HF tok/s':>10} {'ours tok/s':>11} {'ratio':>7}  same greedy outputs")
    for dtype in args.dtypes.split(","):
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype]).eval()
        engine = Engine(str(model_dir), dtype=dtype, max_batch_size=max(int(b) for b in args.batches.split(",")))
        prompts = [engine.encode(m) for m in messages]
        # Warm up both (allocator, kernels) on one short prompt.
        hf_generate(hf, tok, prompts[:1], 1, 4)
        ours_generate(engine, prompts[:1], 1, 4)
        for batch in [int(b) for b in args.batches.split(",")]:
            ref, t_hf = timed(hf_generate, hf, tok, prompts, batch, args.max_tokens)
            got, t_ours = timed(ours_generate, engine, prompts, batch, args.max_tokens)
            n = len(prompts) * args.max_tokens
            same = sum(a == b for a, b in zip(ref, got))
            agree = sum(_common_prefix(a, b) for a, b in zip(ref, got)) / n
            print(f"{dtype:<6} {batch:>5} {n / t_hf:>10.1f} {n / t_ours:>11.1f} {t_hf / t_ours:>6.2f}x  "
                  f"{same}/{len(prompts)} (tokens before the first divergence: {100 * agree:.0f}%)", flush=True)
        del hf, engine


if __name__ == "__main__":
    main()
