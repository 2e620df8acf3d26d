"""The model runner: the one place the engine runs a model (the target, a chain head, a draft model).

Work is a list of items (sequence id, first KV index, end index) over the page allocator the
scheduler owns: "run KV entries [start, end) of this sequence over its cached prefix". The runner
turns items into AttentionMetadata (RoPE positions, cache slots, page tables, tree masks), plans
the attention backend once per step, runs the model over its own KV cache, and returns hidden
states (plus the aux states a head captures). Moving KV entries (the compaction after a tree step)
happens here too, so a model's cache tensors change in one place and the allocator in another (the
scheduler). This is the boundary where persistent buffers and captured CUDA graphs belong; today
every forward runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from headstart.inference.kv_cache import KVCache, PageAllocator
from headstart.nn.attention import AttentionMetadata

Items = list[tuple[str, int, int]]  # (sequence id, start, end): KV indices run this forward


def build_metadata(allocator: PageAllocator, items: Items, device: torch.device,
                   custom_masks: list[torch.Tensor | None] | None = None,
                   positions_override: list[list[int]] | None = None) -> AttentionMetadata:
    """Metadata for running KV indices [start, end) of each listed sequence over its cached prefix.

    The slots must be reserved. Queries are the last end - start KV entries of a sequence whose KV
    then holds `end` entries. RoPE positions equal the KV indices unless overridden (tree nodes sit
    at KV index n + node but RoPE position n + depth).
    """
    positions: list[int] = []
    slots: list[int] = []
    indptr = [0]
    tables = []
    for b, (seq_id, start, end) in enumerate(items):
        positions.extend(positions_override[b] if positions_override is not None else range(start, end))
        slots.extend(allocator.slots(seq_id, start, end))
        indptr.append(indptr[-1] + end - start)
        tables.append(allocator.page_table(seq_id))
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    kv_lens = [end for _, _, end in items]
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        page_table=table.to(device),
        page_size=allocator.page_size,
        q_lens_cpu=[end - start for _, start, end in items],
        kv_lens_cpu=kv_lens,
        custom_masks=custom_masks,
    )


class ModelRunner:
    """Runs one model of the engine over its paged KV cache.

    `model` is a LlamaForCausalLM (the target, or a draft model), a DraftHead with a KV cache (mtp,
    eagle1, deepseek_mtp, eagle3, draft_lm) or anything with the same forward signature.
    """

    def __init__(self, model: Any, cache: KVCache, allocator: PageAllocator, backend: Any,
                 device: torch.device) -> None:
        from headstart.models.base import CausalLM

        self.model, self.cache, self.allocator, self.backend, self.device = model, cache, allocator, backend, device
        self.is_lm = isinstance(model, CausalLM)

    def metadata(self, items: Items, masks: list[torch.Tensor | None] | None = None,
                 positions: list[list[int]] | None = None) -> AttentionMetadata:
        return build_metadata(self.allocator, items, self.device, custom_masks=masks, positions_override=positions)

    def forward(self, tokens: Seq[int] | torch.Tensor, meta: AttentionMetadata, features: torch.Tensor | None = None,
                capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Hidden states (N, D) for the N tokens of `meta`'s items, and captured aux states (targets)."""
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.long)
        ids = ids.to(self.device)
        with torch.inference_mode():
            if self.is_lm:
                return self.model(ids, meta, self.cache.layers, self.backend, capture=capture)
            self.model.plan(meta, self.backend)
            return self.model.forward_hidden(ids, features, meta, self.cache.layers, self.backend), {}

    def run(self, tokens: Seq[int] | torch.Tensor, items: Items, *, features: torch.Tensor | None = None,
            capture: tuple[int, ...] = (), masks: list[torch.Tensor | None] | None = None,
            positions: list[list[int]] | None = None
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor], AttentionMetadata]:
        meta = self.metadata(items, masks, positions)
        h, aux = self.forward(tokens, meta, features, capture)
        return h, aux, meta

    def write_context(self, items: Items, states: torch.Tensor) -> None:
        """A DFlash drafter's context: K/V of KV indices [start, end) of each item computed from
        `states` (one row per index) and written into every layer's cache, with no query."""
        meta = self.metadata(items)
        with torch.inference_mode():
            self.model.write_context(states, meta, self.cache.layers)

    def logits(self, h: torch.Tensor, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """Logits (fp32 for the target) of the hidden states, at `rows` only if given."""
        if rows is not None:
            h = h[torch.as_tensor(rows, device=h.device)]
        with torch.inference_mode():
            return self.model.compute_logits(h)

    def move_kv(self, seq_id: str, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of the sequence's KV indices `src` to `dst` in every layer (tree compaction)."""
        if not src:
            return
        start, end = min(src + dst), max(src + dst) + 1
        slots = self.allocator.slots(seq_id, start, end)
        from_slots = torch.tensor([slots[i - start] for i in src], device=self.device)
        to_slots = torch.tensor([slots[i - start] for i in dst], device=self.device)
        for kc, vc in self.cache.layers:
            for c in (kc, vc):
                flat = c.view(-1, c.shape[2], c.shape[3])
                flat.index_copy_(0, to_slots, flat[from_slots])
