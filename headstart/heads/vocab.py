"""Reduced draft vocabularies (EAGLE-3 style): the N most frequent supervised target tokens.

`d2t[i]` is an offset: draft id i means target id `i + d2t[i]` (the SGLang / vLLM convention);
`t2d[t]` is True for target ids that are in the draft vocabulary.
"""

from __future__ import annotations

import torch


def build_vocab_maps(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_counts (V,) -> d2t int64 (Vd,), t2d bool (V,). Ties go to the lower token id.

    Draft ids are assigned in increasing target-id order, so `d2t` is non-decreasing.
    """
    vocab = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab}], got {draft_vocab_size}")
    counts = token_counts.to(torch.float64).flatten()
    # Stable sort on (-count, id): the most frequent first, ties by id.
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values  # (Vd,) target ids, ascending
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.to(torch.int64), t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Map draft-vocabulary ids to target ids."""
    return draft_ids + d2t[draft_ids]
