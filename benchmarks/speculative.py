"""Speculative decoding on SmolLM2-135M: step costs, our AR engine vs HF, every proposer, in one run.

    .venv/bin/python benchmarks/speculative.py                 # auto dtype, batch 1 and 4, greedy and T=1
    .venv/bin/python benchmarks/speculative.py --quick         # step costs, AR vs HF, chain + tree, greedy
    .venv/bin/python benchmarks/speculative.py --head DIR      # another chain head (default: the shipped one)

Part 1, step costs: one target forward + logits over a cached context, for q = 1 row (an AR step)
and q = k + 1 rows (a chain verify), with the engine's kernels (row-invariant, headstart.kernels)
and with the previous ones (torch matmuls, fp16 GEMV for one row, torch attention), side by side.
Part 2: tokens/s of AR and every proposer against HF `generate` (batch 1), and whether greedy
speculative output equals greedy AR output for every prompt. Proposers: the shipped (or --head)
chain head as chain and EAGLE-2 tree; a draft_lm of the target's first --draft-layers layers and
untrained Medusa heads (stand-ins, labelled so); HF assisted generation with the same truncated draft.
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
from headstart.hardware import describe, resolve_dtype  # noqa: E402
from headstart.heads import HeadConfig, build_head, load_head  # noqa: E402
from headstart.inference import Engine, SamplingParams  # noqa: E402
from headstart.inference.runner import build_metadata  # noqa: E402
from headstart.inference.scheduler import one_step_prefill_budget  # noqa: E402
from headstart.inference.speculation import SpecConfig, SpecMetrics  # noqa: E402
from headstart.models.llama import DTYPES, load_llama  # noqa: E402
from headstart.nn.linear import Linear, enable_cpu_kernels  # noqa: E402
from headstart.nn.norm import RMSNorm  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "heads" / "smollm2-135m-mtp"


def previous_kernels(target) -> Engine:
    """An engine on the kernels the engine used before the row-invariant ones (the baseline)."""
    engine = Engine(target, cpu_kernels=False)
    enable_cpu_kernels(target, rowwise_kernels=False)  # fp16 / transposed GEMV for one-row matmuls
    return engine


def reset_kernels(target) -> None:
    for m in target.modules():
        if isinstance(m, (Linear, RMSNorm)):
            m.disable_cpu_kernels()


def step_ms(engine: Engine, context: int, rows: int, reps: int) -> float:
    """Median ms of one target forward over `rows` new tokens after `context` cached ones, plus the
    logits of every new row (what an AR step or a verify step runs)."""
    alloc, vocab = engine.allocator, engine.model.config.vocab_size
    sid = f"bench-{context}-{rows}"
    alloc.reserve(sid, context + rows)
    prefix = torch.randint(0, vocab, (context,))
    with torch.inference_mode():
        engine.model(prefix, build_metadata(alloc, [(sid, 0, context)], engine.device), engine.cache.layers,
                     engine.backend)
        ids = torch.randint(0, vocab, (rows,))
        times = []
        for _ in range(reps + 2):
            t = time.perf_counter()
            meta = build_metadata(alloc, [(sid, context, context + rows)], engine.device)
            h, _ = engine.model(ids, meta, engine.cache.layers, engine.backend)
            engine.model.compute_logits(h).argmax(-1).tolist()
            times.append(time.perf_counter() - t)
    alloc.release(sid)
    return sorted(times[2:])[len(times[2:]) // 2] * 1e3


def run_engine(target, spec, prompts, params, batch):
    # Each batch group prefilled in one step, as eval does.
    engine = Engine(target, spec=spec, max_batch_size=batch, max_batched_tokens=one_step_prefill_budget(prompts, batch))
    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    engine.spec_metrics = SpecMetrics(positions=engine.spec_metrics.positions)
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i:i + batch], [params[j] for j in range(i, min(i + batch, len(prompts)))])
    seconds = time.perf_counter() - start
    n = sum(len(o.token_ids) for o in outs)
    m = engine.spec_metrics.summary()
    split = (m.get("draft_seconds", 0.0), m.get("verify_seconds", 0.0)) if spec is not None else None
    return n / seconds, m["tau"] if spec is not None else None, split, [o.token_ids for o in outs]


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
    ap.add_argument("--contexts", default="128,512", help="cached tokens for the step-cost table")
    ap.add_argument("--head", default=None, help="a trained chain head (default: the shipped SmolLM2 head)")
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, batch 1, greedy, chain + tree")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens, args.batches, args.temperatures = 4, 32, "1", "0"
    args.dtype = resolve_dtype(args.dtype)
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model("smollm2-135m")
    target = load_llama(model_dir, args.dtype)
    print(f"SmolLM2-135M {args.dtype} on {describe('cpu')}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")

    k = args.k
    print(f"\n1. step costs (median ms; one forward + logits of every new row; verify = k + 1 = {k + 1} rows)")
    print(f"{'kernels':<44} {'context':>7} {'AR step':>8} {'verify':>8} {'verify/AR':>9}")
    for context in [int(c) for c in args.contexts.split(",")]:
        for name in ("previous: torch + fp16 GEMV + torch attn", "ours: row-invariant"):
            reset_kernels(target)
            engine = previous_kernels(target) if name.startswith("previous") else Engine(target)
            ar = step_ms(engine, context, 1, 15)
            verify = step_ms(engine, context, k + 1, 15)
            print(f"{name:<44} {context:>7} {ar:>8.2f} {verify:>8.2f} {verify / ar:>8.2f}x", flush=True)
    reset_kernels(target)

    untrained = args.head is None and not SHIPPED.is_dir()
    head_dir = args.head or (SHIPPED if SHIPPED.is_dir() else None)
    head = load_head(head_dir, target) if head_dir else build_head(HeadConfig(head_type="mtp"), target)
    medusa = build_head(HeadConfig(head_type="medusa", medusa_num_heads=k), target)
    draft = build_head(HeadConfig(head_type="draft_lm", num_layers=args.draft_layers), target)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[args.dtype]).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[args.dtype]).eval()
    hf_draft.model.layers = hf_draft.model.layers[: args.draft_layers]
    hf_draft.config.num_hidden_layers = args.draft_layers

    tok_engine = Engine(target)
    prompts = [tok_engine.encode(m) for m in sharegpt_prompts(args.prompts)]
    del tok_engine
    label = "untrained, init from target" if untrained else Path(head_dir).name
    methods = {
        "AR (ours)": None,
        f"chain mtp k={k} ({label})": SpecConfig(method="chain", k=k, head=head),
        f"tree mtp d=4 top4 16tok ({label})": SpecConfig(method="tree", k=4, head=head, tree_topk=4, tree_tokens=16),
    }
    if not args.quick:
        methods[f"draft {args.draft_layers}-layer stand-in k={k}"] = SpecConfig(method="draft", k=k, draft=draft)
        methods[f"medusa {k} heads (untrained)"] = SpecConfig(method="medusa", k=k, head=medusa)
    print(f"\n2. {len(prompts)} ShareGPT prompts, {args.max_tokens} new tokens; 'same' = greedy output equals "
          "our AR output for every prompt")
    print(f"{'method':<50} {'batch':>5} {'T':>3} {'tau':>6} {'tok/s':>8} {'vs HF':>7} {'vs AR':>7} {'same':>5}  "
          "draft/verify s")
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        hf_tps = run_hf(hf, prompts, args.max_tokens, temperature)
        print(f"{'HF generate':<50} {1:>5} {temperature:>3g} {'':>6} {hf_tps:>8.1f} {1.0:>6.2f}x {'':>7}", flush=True)
        if not args.quick:
            assisted = run_hf(hf, prompts, args.max_tokens, temperature, assistant=hf_draft)
            print(f"{'HF assisted, same ' + str(args.draft_layers) + '-layer draft':<50} {1:>5} {temperature:>3g} "
                  f"{'':>6} {assisted:>8.1f} {assisted / hf_tps:>6.2f}x {'':>7}", flush=True)
        for batch in [int(b) for b in args.batches.split(",")]:
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i, ignore_eos=True)
                      for i in range(len(prompts))]
            ar_tps, ar_out = None, None
            for name, spec in methods.items():
                tps, tau, split, outs = run_engine(target, spec, prompts, params, batch)
                if ar_tps is None:
                    ar_tps, ar_out = tps, outs
                same = ("yes" if outs == ar_out else "NO") if temperature == 0 and spec is not None else ""
                tau_s = f"{tau:.2f}" if tau is not None else ""
                split_s = f"{split[0]:.1f}/{split[1]:.1f}" if split else ""
                print(f"{name:<50} {batch:>5} {temperature:>3g} {tau_s:>6} {tps:>8.1f} {tps / hf_tps:>6.2f}x "
                      f"{tps / ar_tps:>6.2f}x {same:>5}  {split_s}", flush=True)


if __name__ == "__main__":
    main()
