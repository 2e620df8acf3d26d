"""One DeepSeek MoE layer of DeepSeek-V2-Lite's shape (hidden 2048, 64 routed experts of width 1408, 6 per
token, 2 shared experts, greedy softmax routing) and a V2-Lite-shape prefill (two decoder layers of V2-Lite's
widths, the second a MoE layer; 8,192-token vocabulary), this tree beside a baseline tree (a git revision
checked out into a temporary worktree: default the commit before the stacked experts), each in its own
process, in one run:

- MoE layer forward, no grad (prefill / a frozen target), fp32 and bf16: ms and aten ops;
- MoE layer forward + backward (training), fp32: ms and aten ops;
- MoE layer forward with the engine's CPU kernels (row-invariant), 4 rows (a verify step), bf16: ms;
- prefill of 4 prompts x 128 tokens through the Engine, bf16: ms.

    .venv/bin/python benchmarks/moe.py                     # baseline f1b15ab
    .venv/bin/python benchmarks/moe.py --baseline HEAD~2 --tokens 256

The aten op count is what a GPU launches (the profiler on CPU; the per-expert matmuls CPU's `_grouped_mm` runs
inside itself are not counted: on a GPU it is one kernel); the host syncs per training forward are
counted by tests/test_experts.py (none now; one `tolist` per layer before). Random weights, nothing
downloaded. Name the CPU beside the figures.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V2_LITE = dict(model_type="deepseek_v2", vocab_size=8192, hidden_size=2048, intermediate_size=10944,
               moe_intermediate_size=1408, num_hidden_layers=2, num_attention_heads=16, q_lora_rank=None,
               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6,
               max_position_embeddings=4096, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
               first_k_dense_replace=1, topk_method="greedy", scoring_func="softmax", routed_scaling_factor=1.0,
               norm_topk_prob=False, n_group=1, topk_group=1, moe_layer_freq=1, rope_theta=10000.0)


def _best(fn, repeat: int = 3) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1000


def _ops(fn) -> int:  # noqa: ANN001
    """aten ops, not counting those inside `aten::_grouped_mm`: on CPU it runs one matmul (and a host read)
    per expert, on a GPU it is one kernel."""
    from torch.profiler import profile

    with profile() as prof:
        fn()

    def inside_grouped(e) -> bool:  # noqa: ANN001
        e = e.cpu_parent
        while e is not None:
            if e.name == "aten::_grouped_mm":
                return True
            e = e.cpu_parent
        return False

    return sum(1 for e in prof.events() if e.name.startswith("aten::") and not inside_grouped(e))


def measure(tokens: int) -> dict[str, float]:
    """Runs inside the tree under test (its headstart is on sys.path)."""
    import torch

    from headstart.models.deepseek import DeepseekConfig, MoE
    from headstart.nn.linear import enable_cpu_kernels

    torch.manual_seed(0)
    cfg = DeepseekConfig.from_hf(dict(V2_LITE))
    out: dict[str, float] = {}
    x = torch.randn(tokens, cfg.hidden_size)
    moe = MoE(cfg)
    with torch.no_grad():
        out["fwd fp32 ms"] = _best(lambda: moe(x))
        out["fwd fp32 ops"] = _ops(lambda: moe(x))
    xg = x.clone().requires_grad_(True)

    def train() -> None:
        moe(xg).square().mean().backward()
        moe.zero_grad(set_to_none=True)

    out["fwd+bwd fp32 ms"] = _best(train)
    out["fwd+bwd fp32 ops"] = _ops(train)
    moe = moe.to(torch.bfloat16)
    for m in moe.modules():  # routers stay fp32, as the loader keeps them
        if type(m).__name__ == "Router":
            m.float()
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        out["fwd bf16 ms"] = _best(lambda: moe(xb))
        enable_cpu_kernels(moe, True)
        out["engine 4 rows bf16 ms"] = _best(lambda: moe(xb[:4]), repeat=10)
    out["prefill bf16 ms"] = _prefill()
    return out


def _prefill() -> float:
    import torch

    from headstart.inference import Engine, SamplingParams
    from headstart.models.deepseek import DeepseekConfig, DeepseekForCausalLM, keep_routers_fp32

    torch.manual_seed(0)
    model = DeepseekForCausalLM(DeepseekConfig.from_hf(dict(V2_LITE))).to(torch.bfloat16).eval()
    keep_routers_fp32(model)
    for p in model.parameters():
        p.requires_grad_(False)
    eng = Engine(model, page_size=16, max_batch_size=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 8192, (128,), generator=g).tolist() for _ in range(4)]
    one = [SamplingParams(max_tokens=1, ignore_eos=True)] * 4
    return _best(lambda: eng.generate(prompts, one), repeat=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="f1b15ab", help="git revision of the baseline tree")
    ap.add_argument("--tokens", type=int, default=512, help="rows through the MoE layer")
    args = ap.parse_args()
    from common import baseline_tree, measure_in_tree

    with baseline_tree(args.baseline) as base:
        before = measure_in_tree(base, f"moe.measure({args.tokens})", 3600)
    after = measure_in_tree(ROOT, f"moe.measure({args.tokens})", 3600)
    import torch

    print(f"DeepSeek-V2-Lite-shape MoE layer ({args.tokens} tokens) and 2-layer prefill, {torch.get_num_threads()} "
          f"threads: baseline {args.baseline} vs this tree")
    print("| measure | before | after | before / after |")
    print("|---|---|---|---|")
    for key, b in before.items():
        a = after[key]
        print(f"| {key} | {b:.0f} | {a:.0f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
