"""One rank of a tensor-parallel run for tests/test_tensor_parallel.py: launched by torchrun (gloo on
CPU), or as a plain process for the 1-rank reference. Loads the target with its shard of the
weights, then records what the tests compare: prefill logits and hidden states, greedy generations
(plain, continuous batching over pages), a chain head's speculation and its acceptance. Rank 0
writes them to OUT (torch.save)."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--head", default=None)
    ap.add_argument("--dtype", default="fp32")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the ranks share this machine's cores

    from headstart.heads import load_head
    from headstart.inference import Engine, SamplingParams
    from headstart.inference.speculation import SpecConfig
    from headstart.models.llama import load_llama
    from headstart.nn.attention import PackedCausalAttention, packed_metadata
    from headstart.nn.parallel import init_tensor_parallel

    tp, _, _ = init_tensor_parallel(args.tp, timeout_s=300)
    model = load_llama(args.model, args.dtype, tp=tp)
    prompts = [[(7 * i + 3 * j) % 300 + 5 for j in range(4 + 3 * i)] for i in range(5)]
    flat = torch.tensor([t for p in prompts for t in p])
    meta = packed_metadata([len(p) for p in prompts])
    with torch.inference_mode():
        h, aux = model(flat, meta, [None] * model.num_layers, PackedCausalAttention(), capture=(0, 1))
        logits = model.compute_logits(h)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 14, 5, 11, 16)]
    plain = Engine(model, page_size=4, num_pages=48, max_batch_size=3).generate(prompts, params)
    record = {
        "rank": tp.rank, "size": tp.size, "local_heads": model.num_local_heads,
        "local_kv_heads": model.num_local_kv_heads, "fingerprint": model.fingerprint(),
        "hidden": h, "aux": aux, "logits": logits, "plain": [o.token_ids for o in plain],
    }
    if args.head:
        head = load_head(args.head, model)
        spec_cfg = SpecConfig(method="chain", k=3, head=head)
        eng = Engine(model, page_size=4, num_pages=64, max_batch_size=3, spec=spec_cfg)
        spec = eng.generate(prompts, params)
        record["spec"] = [o.token_ids for o in spec]
        if head.config.draft_vocab_size:
            from headstart.heads.vocab import restricted_lm_head

            record["restricted"] = restricted_lm_head(head, model.lm_head, head.d2t).weight.detach().clone()
        record["spec_metrics"] = eng.spec_metrics.summary()
        # Sampled drafts verified with the full-q rule (q placed on the whole vocabulary), seeded.
        sampled = [SamplingParams(max_tokens=10, temperature=0.8, seed=3 + i, ignore_eos=True) for i in range(5)]
        spec_cfg = SpecConfig(method="chain", k=3, head=head, draft_sampling=True)
        eng = Engine(model, page_size=4, num_pages=64, max_batch_size=3, spec=spec_cfg)
        record["sampled"] = [o.token_ids for o in eng.generate(prompts, sampled)]
    if tp.rank == 0:
        torch.save(record, args.out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from headstart.launch import end_rank

    sys.path.insert(0, os.path.dirname(__file__))
    main()
    end_rank(0)  # as the command line does: gloo's threads may still free tensors (tests/exit_worker.py)
