"""Validation through the production path: the engine itself, speculating with the head in training.

`engine_acceptance` builds an `Engine` around the (frozen) target with an in-memory copy of the
head in the target's dtype — exactly what `load_head` would build from a checkpoint, without the
file round trip — and decodes held-out prompts greedily with `head.k` drafts per step.
"""

from __future__ import annotations

from typing import Any

import torch

from headstart.heads import build_head
from headstart.heads.base import DraftHead
from headstart.inference.speculation import SpecConfig, spec_method
from headstart.models.llama import LlamaForCausalLM


def serving_copy(head: DraftHead, target: LlamaForCausalLM) -> DraftHead:
    """The head as the engine would load it: same config and weights, in the target's dtype."""
    copy = build_head(head.config, target, init_from_target=False)
    copy.load_state_dict({k: v.detach() for k, v in head.state_dict().items()})
    return copy.eval()


def engine_acceptance(target: LlamaForCausalLM, head: DraftHead, prompts: list[list[int]], *, k: int,
                      max_tokens: int, tokenizer: Any = None, seed: int = 0, backend: str = "auto",
                      prefill_cap: int | None = None) -> dict[str, Any]:
    """Greedy speculative decoding of `prompts` (token ids) -> the engine's acceptance summary. One engine runs
    them all: at once when they hold at most `prefill_cap` prompt tokens (scheduler.MEASURED_PREFILL_CAP), each
    prefilled in one step; else as many at a time as hold about that many, in turn (continuous batching, the
    KV cache sized for them). Either way every trace is the prompt's own (the speculating engine holds its
    decoding sequences while others prefill)."""
    from headstart.inference.engine import Engine
    from headstart.inference.sampler import SamplingParams
    from headstart.inference.scheduler import kv_pages_for, one_step_prefill_budget, prompts_at_once
    from headstart.nn.linear import cpu_kernels_restored
    from headstart.sizing import KV_PAGE_TOKENS

    if not prompts:
        return {"steps": 0, "tau": None, "alpha": None, "accept_rate_per_pos": []}
    copy = serving_copy(head, target)
    method = spec_method(copy.config.head_type)
    if method == "medusa":
        k = min(k, copy.config.medusa_num_heads)
    if method == "block":
        k = min(k, copy.config.block_size - 1)
    spec = SpecConfig(method=method, k=k, head=copy if method != "draft" else None,
                      draft=copy if method == "draft" else None)
    page = KV_PAGE_TOKENS
    batch = prompts_at_once(prompts, prefill_cap)
    pages = kv_pages_for(prompts, max_tokens, batch, spec.lookahead, page, target.config.max_position_embeddings)
    # The engine switches the target's linears to its inference kernels; training keeps using the
    # target afterwards, with torch's kernels: put them back when validation is done.
    with cpu_kernels_restored(target), torch.inference_mode():
        engine = Engine(target, tokenizer=tokenizer, device=target.model.embed_tokens.weight.device, page_size=page,
                        num_pages=pages, max_batch_size=batch,
                        max_batched_tokens=one_step_prefill_budget(prompts, cap=prefill_cap), seed=seed, spec=spec,
                        backend=backend)
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    out = engine.spec_metrics.summary()
    out["prompts"] = len(prompts)
    out["k"] = k
    return out


def heldout_prompts(input_ids: list[list[int]], loss_mask: list[list[int]], n: int, turn: int = 1) -> list[list[int]]:
    """The `turn`-th user turn of each held-out conversation that has one, as token ids: everything before the
    first supervised token of its `turn`-th reply (system, the earlier turns with their replies, this user turn
    and the generation prompt). turn 1: the first user turn alone."""
    if turn < 1:
        raise ValueError(f"turn must be >= 1, got {turn}")
    out = []
    for ids, mask in zip(input_ids, loss_mask):
        if len(out) >= n:
            break
        starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]  # where each reply begins
        if len(starts) >= turn and starts[turn - 1] > 0:
            out.append(list(ids[: starts[turn - 1]]))
    return out
