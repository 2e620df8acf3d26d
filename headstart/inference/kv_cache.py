"""Paged KV cache: a page allocator (bookkeeping) and per-model cache tensors (storage).

One allocator serves every model of a speculative pair: target and draft use the same page ids for
the same sequence, each with its own tensors. A sequence's page table lists its pages in order;
token position p lives in page table[p // page_size] at offset p % page_size.

Prefix caching (`prefix_cache=True`, target-only engines): a full page whose K/V are computed is
registered under its tokens and the page before it; a new sequence whose prompt starts with
registered pages takes them (reference-counted) instead of recomputing them. A released page
that is registered is kept, evictable, until a fresh page is needed (least recently used first):
the next turn of a conversation, or a preempted sequence, finds its history still cached. Keys
are exact (the page's tokens and the serial of the page before it), so a hash collision cannot
hand out another prompt's K/V.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from headstart.nn.attention import KVPages


class OutOfPages(Exception):
    """Not enough free pages; the scheduler preempts rather than crash."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = False) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() hands out low ids first
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}  # tokens reserved per sequence
        # prefix cache: (serial of the page before, the page's tokens) -> (serial, page); a page's key;
        # sequences holding each page; registered pages no sequence holds, least recently released first;
        # per sequence, the serials of its leading full pages that are registered or were matched
        self._blocks: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._refs: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._chain: dict[str, list[int]] = {}
        self._serials = itertools.count(1)  # 0: "no page before" (the first page of a prompt)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    def _take(self) -> int:
        """A fresh page: a never-registered one first, else the least recently used idle registered one."""
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._idle.popitem(last=False)
            del self._blocks[self._key_of.pop(page)]
        self._refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        """One sequence lets go of a page: the last holder frees it, or leaves it idle if registered."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            del self._refs[page]
            if page in self._key_of:
                self._idle[page] = None
            else:
                self._free.append(page)

    def match(self, seq_id: str, token_ids: list[int]) -> int:
        """For a sequence with no pages yet: take the registered pages its tokens start with, leaving at
        least its last token to compute (its logits are needed), and return how many tokens they hold."""
        if not self.prefix_cache or seq_id in self._tables:
            return 0
        ps, parent, table, chain = self.page_size, 0, [], []
        for start in range(0, (len(token_ids) - 1) // ps * ps, ps):
            hit = self._blocks.get((parent, tuple(token_ids[start:start + ps])))
            if hit is None:
                break
            parent, page = hit
            if page in self._idle:
                del self._idle[page]
            self._refs[page] = self._refs.get(page, 0) + 1
            table.append(page)
            chain.append(parent)
        if table:
            self._tables[seq_id], self._chain[seq_id] = table, chain
            self._lengths[seq_id] = len(table) * ps
        return len(table) * ps

    def uncommitted(self, seq_id: str, cached: int) -> bool:
        """Whether `commit` has full pages to register (cheap: callers skip building the token list)."""
        return self.prefix_cache and cached // self.page_size > len(self._chain.get(seq_id, ()))

    def commit(self, seq_id: str, token_ids: list[int], cached: int) -> None:
        """Register the sequence's full pages among its first `cached` tokens, whose K/V are now
        computed and never rewritten (no speculation shares a prefix-cached allocator)."""
        if not self.prefix_cache:
            return
        chain, table, ps = self._chain.setdefault(seq_id, []), self._tables.get(seq_id, []), self.page_size
        while len(chain) < min(cached // ps, len(table)):
            i = len(chain)
            key = (chain[-1] if chain else 0, tuple(token_ids[i * ps:(i + 1) * ps]))
            page = table[i]
            hit = self._blocks.get(key)
            if hit is not None:  # the same tokens computed twice (two sequences at once): keep the first
                chain.append(hit[0])
                continue
            serial = next(self._serials)
            if page in self._key_of:  # cannot happen: a page is registered once, while a sequence holds it
                raise AssertionError(f"page {page} of {seq_id} is registered already")
            self._blocks[key], self._key_of[page] = (serial, page), key
            chain.append(serial)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def length(self, seq_id: str) -> int:
        return self._lengths.get(seq_id, 0)

    def can_reserve(self, seq_id: str, num_tokens: int) -> bool:
        have = len(self._tables.get(seq_id, ()))
        return self.pages_for(num_tokens) - have <= self.num_free

    def reserve(self, seq_id: str, num_tokens: int) -> None:
        """Grow the sequence to hold `num_tokens` tokens (prefill, decode or k lookahead slots)."""
        table = self._tables.setdefault(seq_id, [])
        need = self.pages_for(num_tokens) - len(table)
        if need > self.num_free:
            if not table:
                del self._tables[seq_id]
            raise OutOfPages(f"{seq_id}: needs {need} more pages, {self.num_free} free")
        for _ in range(max(need, 0)):
            table.append(self._take())
        self._lengths[seq_id] = max(self._lengths.get(seq_id, 0), num_tokens)

    def rollback(self, seq_id: str, n: int) -> None:
        """Forget the last n token slots (rejected draft tokens); pages no longer needed go back."""
        length = self._lengths[seq_id] - n
        if length < 0:
            raise ValueError(f"{seq_id}: cannot roll back {n} of {self._lengths[seq_id]} slots")
        self._lengths[seq_id] = length
        table = self._tables[seq_id]
        while len(table) > self.pages_for(length):
            self._drop(table.pop())
        chain = self._chain.get(seq_id)
        if chain is not None:
            del chain[length // self.page_size:]

    def release(self, seq_id: str) -> None:
        for page in reversed(self._tables.pop(seq_id, [])):  # the tail first: evicted before the shared head
            self._drop(page)
        self._lengths.pop(seq_id, None)
        self._chain.pop(seq_id, None)

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
