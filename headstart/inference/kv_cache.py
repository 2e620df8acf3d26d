"""Paged KV cache: a page allocator (bookkeeping) and per-model cache tensors (storage).

One allocator serves every model of a speculative pair: target and draft use the same page ids for
the same sequence, each with its own tensors. A sequence's page table lists its pages in order;
token position p lives in page table[p // page_size] at offset p % page_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headstart.nn.attention import KVPages


class OutOfPages(Exception):
    """Not enough free pages; the scheduler preempts rather than crash."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() hands out low ids first
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}  # tokens reserved per sequence

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def length(self, seq_id: str) -> int:
        return self._lengths.get(seq_id, 0)

    def can_reserve(self, seq_id: str, num_tokens: int) -> bool:
        have = len(self._tables.get(seq_id, ()))
        return self.pages_for(num_tokens) - have <= len(self._free)

    def reserve(self, seq_id: str, num_tokens: int) -> None:
        """Grow the sequence to hold `num_tokens` tokens (prefill, decode or k lookahead slots)."""
        table = self._tables.setdefault(seq_id, [])
        need = self.pages_for(num_tokens) - len(table)
        if need > len(self._free):
            if not table:
                del self._tables[seq_id]
            raise OutOfPages(f"{seq_id}: needs {need} more pages, {len(self._free)} free")
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        self._lengths[seq_id] = max(self._lengths.get(seq_id, 0), num_tokens)

    def rollback(self, seq_id: str, n: int) -> None:
        """Forget the last n token slots (rejected draft tokens); pages no longer needed go back."""
        length = self._lengths[seq_id] - n
        if length < 0:
            raise ValueError(f"{seq_id}: cannot roll back {n} of {self._lengths[seq_id]} slots")
        self._lengths[seq_id] = length
        table = self._tables[seq_id]
        while len(table) > self.pages_for(length):
            self._free.append(table.pop())

    def release(self, seq_id: str) -> None:
        for page in reversed(self._tables.pop(seq_id, [])):
            self._free.append(page)
        self._lengths.pop(seq_id, None)

    def page_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Flat cache slots for token positions [start, end) of a sequence."""
        if end > self._lengths.get(seq_id, 0):
            raise ValueError(f"{seq_id}: positions up to {end} requested, {self.length(seq_id)} reserved")
        table, ps = self._tables[seq_id], self.page_size
        return [table[p // ps] * ps + p % ps for p in range(start, end)]


@dataclass(kw_only=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    shared: bool = False  # keys and values are one tensor (MLA's compressed latent + rope key)

    @classmethod
    def of(cls, model: object) -> KVCacheSpec:
        """The cache a target-family model (headstart.models.base.CausalLM) asks for."""
        return cls(num_layers=model.config.num_hidden_layers, num_kv_heads=model.cache_heads,
                   head_dim=model.cache_head_dim, dtype=model.dtype, shared=model.cache_shared)

    def bytes_per_page(self, page_size: int) -> int:
        tensors = 1 if self.shared else 2
        return tensors * self.num_layers * page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class KVCache:
    """One model's K/V storage: per layer a (k, v) pair of (num_pages, page_size, Hkv, Dh) tensors."""

    def __init__(self, spec: KVCacheSpec, num_pages: int, page_size: int, device: torch.device | str) -> None:
        shape = (num_pages, page_size, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.layers: list[KVPages] = []
        for _ in range(spec.num_layers):
            k = torch.zeros(shape, dtype=spec.dtype, device=device)
            # Shared: the layer writes the same tensor as its keys and values (see DeepSeek's MLA).
            self.layers.append((k, k if spec.shared else torch.zeros(shape, dtype=spec.dtype, device=device)))


def pages_for_budget(budget_gb: float, specs: list[KVCacheSpec], page_size: int) -> int:
    """How many pages fit a memory budget shared by several models' caches."""
    per_page = sum(s.bytes_per_page(page_size) for s in specs)
    return max(1, int(budget_gb * 1024**3 // per_page))
