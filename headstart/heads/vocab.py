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


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """(Vd,) the target id of every draft id."""
    return draft_to_target(torch.arange(d2t.numel(), device=d2t.device), d2t)


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab: int) -> None:
    """Refuse maps that do not describe one `draft_vocab_size`-token subset of a `vocab` vocabulary."""
    if d2t.numel() != draft_vocab_size or t2d.numel() != vocab:
        raise ValueError(f"maps of sizes {d2t.numel()} / {t2d.numel()} do not describe a {draft_vocab_size}-token "
                         f"draft vocabulary over {vocab} tokens")
    ids = target_ids(d2t.long())
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"d2t maps draft ids outside the target vocabulary [0, {vocab})")
    if ids.unique().numel() != ids.numel():
        raise ValueError("d2t maps two draft ids to one target token")
    if int(t2d.sum()) != draft_vocab_size or not bool(t2d.bool()[ids].all()):
        raise ValueError("t2d does not mark exactly the tokens d2t maps to")


def restricted_lm_head(owner: object, lm_head: object, d2t: torch.Tensor) -> object:
    """The frozen target lm_head restricted to the draft vocabulary's rows, as a Linear (Vd, d).

    The rows are gathered once and cached on `owner` (not registered: they are the target's weights,
    never trained or saved); the cache is rebuilt when the target's weight, its dtype/device or
    kernel choice, or the maps change. The copy takes the same CPU kernels as the target's lm_head,
    so a draft step's logits cost Vd/V of a full lm_head and keep the row-invariant arithmetic."""
    from headstart.nn.linear import Linear

    w = lm_head.weight
    version = -1 if w.is_inference() else w._version  # in-place changes (load_state_dict, an optimizer) rebuild it
    key = (w.data_ptr(), version, w.dtype, w.device, d2t.data_ptr(), d2t._version, getattr(lm_head, "_rows", 0),
           getattr(lm_head, "_gemv_kind", ""))
    cached = getattr(owner, "_restricted_lm_head", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    lin = Linear(w.shape[1], d2t.numel(), bias=False).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        ids = target_ids(d2t).to(w.device)
        # A tensor-parallel lm_head holds a share of the rows: `rows` brings each from its rank.
        lin.weight.copy_(lm_head.rows(ids) if hasattr(lm_head, "rows") else w.detach()[ids])
    lin.weight.requires_grad_(False)
    rows = getattr(lm_head, "_rows", 0)
    if rows or getattr(lm_head, "_gemv", None) is not None:
        lin.enable_cpu_kernels(rowwise_kernels=bool(rows), max_rows=rows or None)
    object.__setattr__(owner, "_restricted_lm_head", (key, lin))
    return lin
