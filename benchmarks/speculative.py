"""Speculative decoding on SmolLM2-135M: our AR engine vs every proposer vs HF, in one run.

    .venv/bin/python benchmarks/speculative.py                 # bf16, batch 1 and 4, greedy and T=1
    .venv/bin/python benchmarks/speculative.py --head DIR      # use a trained chain head
    .venv/bin/python benchmarks/speculative.py --quick

Until trained heads exist the proposers are honest stand-ins, labelled as such:
  chain / tree / medusa : heads initialised from the target and never trained;
  draft                 : a draft_lm made of the target's first --draft-layers layers (shared embeddings);
  HF assisted           : transformers' assisted generation with the same truncated draft (batch 1).
Prints tau, tokens/s and the speedup over HF `generate` and over our own AR decoding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sharegpt_prompts  # noqa: E402

from headstart.assets import resolve_model  # noqa: E402
from headstart.heads import HeadConfig, build_head, load_head  # noqa: E402
from headstart.inference import Engine, SamplingParams  # noqa: E402
from headstart.inference.spec import SpecConfig  # noqa: E402
from headstart.models.llama import DTYPES, load_llama  # noqa: E402


def run_engine(target, spec, prompts, params, batch):
    engine = Engine(target, spec=spec, max_batch_size=batch)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    engine.spec_metrics.accepted.clear()
    engine.spec_metrics.drafted.clear()
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i:i + batch], [params[j] for j in range(i, min(i + batch, len(prompts)))])
    seconds = time.perf_counter() - start
    n = sum(len(o.token_ids) for o in outs)
    m = engine.spec_metrics.summary()
    split = (m.get("draft_seconds", 0.0), m.get("verify_seconds", 0.0)) if spec is not None else None
    return n / seconds, m["tau"] if spec is not None else None, split


def run_hf(model, prompts, max_tokens, temperature, assistant=None):
    start, n = time.perf_counter(), 0
    for i, p in enumerate(prompts):
        torch.manual_seed(i)
        kw = dict(do_sample=temperature > 0, temperature=temperature or None, top_p=None, top_k=None)
        if assistant is not None:
            kw["num_assistant_tokens"] = 3
        with torch.inference_mode():
            out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 pad_token_id=2, assistant_model=assistant, **kw)
        n += out.shape[1] - len(p)
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--head", default=None, help="a trained chain head checkpoint (default: untrained stand-in)")
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, batch 1, greedy")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.batches, args.temperatures = 4, 32, "1", "0"
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model("smollm2-135m")
    target = load_llama(model_dir, args.dtype)
    untrained = args.head is None
    head = load_head(args.head, target) if args.head else build_head(HeadConfig(head_type="mtp"), target)
    medusa = build_head(HeadConfig(head_type="medusa", medusa_num_heads=args.k), target)
    draft = build_head(HeadConfig(head_type="draft_lm", num_layers=args.draft_layers), target)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[args.dtype]).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[args.dtype]).eval()
    hf_draft.model.layers = hf_draft.model.layers[: args.draft_layers]
    hf_draft.config.num_hidden_layers = args.draft_layers

    tok_engine = Engine(target)
    prompts = [tok_engine.encode(m) for m in sharegpt_prompts(args.prompts)]
    del tok_engine
    label = "trained" if not untrained else "untrained, init from target"
    methods = {
        "AR (ours)": None,
        f"chain mtp k={args.k} ({label})": SpecConfig(method="chain", k=args.k, head=head),
        f"tree mtp d=4 top4 16tok ({label})": SpecConfig(method="tree", k=4, head=head, tree_topk=4, tree_tokens=16),
        f"draft {args.draft_layers}-layer stand-in k={args.k}": SpecConfig(method="draft", k=args.k, draft=draft),
        f"medusa {args.k} heads (untrained)": SpecConfig(method="medusa", k=args.k, head=medusa),
    }
    print(f"SmolLM2-135M {args.dtype}, {len(prompts)} ShareGPT prompts, {args.max_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'method':<50} {'batch':>5} {'T':>3} {'tau':>6} {'tok/s':>8} {'vs HF':>7} {'vs AR':>7}  draft/verify s")
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        hf_tps = run_hf(hf, prompts, args.max_tokens, temperature)
        print(f"{'HF generate':<50} {1:>5} {temperature:>3g} {'':>6} {hf_tps:>8.1f} {1.0:>6.2f}x {'':>7}", flush=True)
        assisted = run_hf(hf, prompts, args.max_tokens, temperature, assistant=hf_draft)
        print(f"{'HF assisted, same ' + str(args.draft_layers) + '-layer draft':<50} {1:>5} {temperature:>3g} "
              f"{'':>6} {assisted:>8.1f} {assisted / hf_tps:>6.2f}x {'':>7}", flush=True)
        for batch in [int(b) for b in args.batches.split(",")]:
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i, ignore_eos=True)
                      for i in range(len(prompts))]
            ar_tps = None
            for name, spec in methods.items():
                tps, tau, split = run_engine(target, spec, prompts, params, batch)
                ar_tps = ar_tps or tps
                tau_s = f"{tau:.2f}" if tau is not None else ""
                split_s = f"{split[0]:.1f}/{split[1]:.1f}" if split else ""
                print(f"{name:<50} {batch:>5} {temperature:>3g} {tau_s:>6} {tps:>8.1f} {tps / hf_tps:>6.2f}x "
                      f"{tps / ar_tps:>6.2f}x  {split_s}", flush=True)


if __name__ == "__main__":
    main()
