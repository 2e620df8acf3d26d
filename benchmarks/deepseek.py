"""Our DeepSeek implementation (MLA over the latent paged cache, MoE) against transformers' own
DeepseekV3ForCausalLM, on one CPU, on a tiny-but-not-trivial random DeepSeek-V3-architecture config:
prefill of a batch of prompts, and greedy decoding of one prompt, in one run, side by side with the
ratio. Both produce the same greedy tokens (checked here; tests/test_deepseek.py checks logits).

    .venv/bin/python benchmarks/deepseek.py [--dtype fp32|bf16] [--new-tokens 64]

Name the CPU beside the figures (grep -o 'avx512_bf16\\|amx_bf16' /proc/cpuinfo): bf16 is only fast
where the CPU computes it natively.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
              num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128,
              qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4,
              n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
              max_position_embeddings=1024, bos_token_id=0, eos_token_id=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="prompts prefilled together")
    args = ap.parse_args()
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from headstart.inference import Engine, SamplingParams
    from headstart.models import load_target

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0, 0.05)
    hf.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_target(d, args.dtype)
    hf = hf.to(dtype)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, CONFIG["vocab_size"], (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    eng = Engine(ours, page_size=16, max_batch_size=args.batch)
    eng.generate([prompts[0][:8]], [SamplingParams(max_tokens=2, ignore_eos=True)])  # warm-up (kernels)

    def ours_prefill() -> None:
        eng.generate(prompts, [SamplingParams(max_tokens=1, ignore_eos=True)] * len(prompts))

    def hf_prefill() -> None:
        with torch.no_grad():
            hf(torch.tensor(prompts))

    def timed(fn) -> float:  # noqa: ANN001
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    pre_ours, pre_hf = timed(ours_prefill), timed(hf_prefill)
    t0 = time.perf_counter()
    got = eng.generate([prompts[0]], [params])[0].token_ids
    dec_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0)[0, args.prompt_tokens:].tolist()
    dec_hf = time.perf_counter() - t0
    same = sum(a == b for a, b in zip(got, want))
    n_pre = args.batch * args.prompt_tokens
    print(f"DeepSeek-V3-architecture, {ours.config.parameter_count() / 1e6:.1f} M parameters "
          f"({ours.config.active_parameter_count() / 1e6:.1f} M active), {args.dtype}, torch threads "
          f"{torch.get_num_threads()}, kernels {eng.kernels}")
    print(f"{'':34}{'headstart':>12}{'transformers':>14}{'ratio':>8}")
    print(f"{'prefill tokens/s (' + str(args.batch) + ' x ' + str(args.prompt_tokens) + ')':34}"
          f"{n_pre / pre_ours:>12,.0f}{n_pre / pre_hf:>14,.0f}{pre_hf / pre_ours:>7.2f}x")
    print(f"{'decode tokens/s (batch 1, ' + str(args.new_tokens) + ' new)':34}"
          f"{args.new_tokens / dec_ours:>12,.1f}{args.new_tokens / dec_hf:>14,.1f}{dec_hf / dec_ours:>7.2f}x")
    print(f"greedy tokens equal: {same} of {len(want)}")


if __name__ == "__main__":
    main()
