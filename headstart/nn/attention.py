"""Multi-head attention over a paged KV cache, with the per-step metadata passed explicitly.

The module projects, normalises (Qwen3 q/k norm), rotates, and hands q/k/v to an attention
*backend* together with the step's `AttentionMetadata`; the backend writes the new K/V into the
cache pages and attends. Backends live in `headstart.inference` (torch SDPA, FlashInfer); this file
only fixes the interface they implement.

Token layout is flat: a step's N query tokens from B sequences are concatenated; sequence b owns
rows qo_indptr[b]:qo_indptr[b+1] and its KV (cached + new) has length kv_lens[b]. Queries are the
*last* q_len positions of their sequence (bottom-right aligned causal mask) unless a custom mask is
given (trees: a query sees the prefix and its ancestors only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from headstart.nn.linear import Linear
from headstart.nn.norm import RMSNorm
from headstart.nn.parallel import SINGLE, TensorParallel
from headstart.nn.rope import RotaryEmbedding

KVPages = tuple[torch.Tensor, torch.Tensor]  # k, v: (num_pages, page_size, Hkv, Dh) each


@dataclass
class AttentionMetadata:
    """Everything a backend needs for one step, built once by the scheduler and read by every layer."""

    positions: torch.Tensor  # (N,) int64 absolute position of each query token
    slot_mapping: torch.Tensor  # (N,) int64 flat cache slot (page * page_size + offset) for its K/V
    qo_indptr: torch.Tensor  # (B+1,) int32 query row offsets per sequence
    kv_lens: torch.Tensor  # (B,) int32 KV length per sequence, new tokens included
    page_table: torch.Tensor  # (B, max_pages) int32 page ids per sequence (padded with 0)
    page_size: int
    q_lens_cpu: list[int]  # host copies: backends plan on them without a device sync
    kv_lens_cpu: list[int]
    # Optional per-sequence boolean masks (q_len, kv_len), True = attend; None = causal.
    custom_masks: list[torch.Tensor | None] | None = None
    # Whether slot_mapping / page_table address a paged KV cache, the engine's (k, v) pages of each layer.
    # False for packed training steps (packed_metadata): no pages; a layer's cache is None, or the caller's
    # own (the TTT unroll's list of steps), and only the backend reads it.
    paged: bool = True
    # Backend-private per-step state (gather indices, planned FlashInfer wrappers, ...).
    backend_state: dict[str, Any] = field(default_factory=dict)
    # Per-step tensors derived once and shared by every layer (e.g. RoPE cos/sin for `positions`).
    step_cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens_cpu) and self.custom_masks is None


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> None:
        """Prepare per-step state once (called before the forward, once per model)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPages,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write k/v (N, Hkv, Dh) into `cache` at meta.slot_mapping, attend; returns (N, Hq, Dh)."""


class Attention(nn.Module):
    def __init__(
        self, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: RotaryEmbedding,
        qkv_bias: bool = False, qk_norm: bool = False, norm_eps: float = 1e-6, in_features: int | None = None,
        o_bias: bool = False, tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        # Under tensor parallelism this rank's heads only (headstart.nn.parallel): qkv is column-
        # parallel, o_proj row-parallel, and the partial outputs are summed over the group.
        self.tp = tp
        if tp.enabled:
            local_kv = tp.kv_heads(num_heads, num_kv_heads)[1]
            num_heads, num_kv_heads = tp.split(num_heads, "num_attention_heads")[1], local_kv
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        # q, k and v in one matmul; the loader maps HF's q_proj/k_proj/v_proj into its row blocks.
        self.qkv_proj = Linear(in_features or hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)  # a row-parallel bias: rank 0 holds it
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.rope = rope

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVPages,
                backend: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]  # x: (N, Din)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # (N, Hq, Dh)
        k = k.view(n, self.num_kv_heads, self.head_dim)  # (N, Hkv, Dh)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, k, meta.positions, meta.step_cache)
        o = backend.forward(q, k, v, cache, meta, self.scale)  # (N, Hq, Dh)
        return self.tp.all_reduce(self.o_proj(o.reshape(n, self.q_size)))


def fused_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """K/V (..., Hkv, D) for a fused SDPA call with q's (..., Hq, D) heads -> (k, v, enable_gqa). CPU flash
    takes grouped heads as they are; CUDA's memory-efficient kernel (the one that takes a mask) does not,
    and a call it refuses falls back to the math kernel, which keeps every score for the backward pass:
    there the K/V heads are repeated instead."""
    group = q.shape[-2] // k.shape[-2]
    if group == 1:
        return k, v, False
    if not q.is_cuda:
        return k, v, True
    return k.repeat_interleave(group, dim=-2), v.repeat_interleave(group, dim=-2), False


@dataclass
class PaddedLayout:
    """Packed rows (N, ...) laid out as padded batches (B_b, L_b, ...), one per *bucket* of sequences: one
    attention call per bucket runs every sequence in it, whatever their number.

    Bucketed (the default): sequences sorted longest first, each bucket holding those at least half as
    long as its longest, so every sequence is padded to at most twice its length: under 2N padded slots
    whatever the mix of lengths (one 4k-token conversation packed with 200 short ones pads them to their
    own bucket's length, not to 4k), in at most log2(longest) + 1 buckets (a sequence of exactly half its
    bucket's longest pads to twice its length; total slots stay under 2N). Unbucketed: one padded batch
    of every sequence (empty ones included) in their order, L the longest. Built once per micro-batch
    (`padded_layout`)."""

    gathers: list[torch.Tensor]  # per bucket (B_b, L_b): packed row of each padded slot; N (a zero row) for padding
    scatter: torch.Tensor  # (N,) each packed row's slot in the buckets' flattened slots, laid end to end

    @property
    def lengths(self) -> list[int]:
        return [g.shape[1] for g in self.gathers]

    @property
    def slots(self) -> int:
        """Padded slots of all buckets (what one padded activation holds per head and channel)."""
        return sum(g.numel() for g in self.gathers)

    def pad(self, x: torch.Tensor) -> list[torch.Tensor]:
        """(N, ...) -> one (B_b, L_b, ...) per bucket; padding slots hold zeros."""
        ext = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        return [ext[g] for g in self.gathers]

    def unpad(self, ys: list[torch.Tensor]) -> torch.Tensor:
        """One (B_b, L_b, ...) per bucket -> (N, ...)."""
        flat = [y.reshape(y.shape[0] * y.shape[1], *y.shape[2:]) for y in ys]
        return (flat[0] if len(flat) == 1 else torch.cat(flat))[self.scatter]

    @staticmethod
    def buckets(lens: list[int]) -> list[list[int]]:
        """Sequence indices per bucket: non-empty sequences longest first, a new bucket wherever a sequence
        is shorter than half its bucket's longest (each pads to at most twice its length)."""
        out: list[list[int]] = []
        for i in sorted((i for i, n in enumerate(lens) if n > 0), key=lambda i: -lens[i]):
            if out and 2 * lens[i] >= lens[out[-1][0]]:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    @classmethod
    def of(cls, lens: list[int], device: torch.device | str, bucketed: bool = True,
           groups: list[list[int]] | None = None) -> PaddedLayout:
        """The layout of rows packed in sequences of `lens` (some may be empty); `groups`: the sequences of
        each bucket, given (the rows of a sequence in none are only padded from, never unpadded to). Built
        on the host from the lengths and copied without waiting: no device sync (a blocking copy to a GPU
        waits for its queue)."""
        lens = [int(n) for n in lens]
        n = sum(lens)
        starts = [0] * len(lens)
        for i in range(1, len(lens)):
            starts[i] = starts[i - 1] + lens[i - 1]
        if groups is None:
            groups = cls.buckets(lens) if bucketed else [list(range(len(lens)))]
        scatter = torch.full((n,), -1, dtype=torch.long)
        gathers, offset = [], 0
        for group in groups or [[]]:
            n_rows = torch.tensor([lens[i] for i in group], dtype=torch.long)
            first = torch.tensor([starts[i] for i in group], dtype=torch.long)
            length = max([lens[i] for i in group] + [1])  # from the host list: no tensor read
            col = torch.arange(length)
            inside = col[None, :] < n_rows[:, None]  # (B_b, L_b)
            gather = torch.where(inside, first[:, None] + col[None, :], n)
            slot = offset + torch.arange(gather.numel()).reshape(gather.shape)
            scatter[gather[inside]] = slot[inside]
            gathers.append(gather.to(device, non_blocking=True))
            offset += gather.numel()
        return cls(gathers, scatter.to(device, non_blocking=True))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True = attend) as SDPA's additive form in the queries' dtype: built once and
    shared by the layers (a boolean one is converted again, and kept for backward, by every call)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def padded_layout(meta: AttentionMetadata) -> PaddedLayout:
    """The padded layout of a packed batch, cached on its metadata (every layer reads the same one). Built
    from the host-side lengths: no device sync."""
    if "padded" not in meta.step_cache:
        meta.step_cache["padded"] = PaddedLayout.of(meta.q_lens_cpu, meta.positions.device)
    return meta.step_cache["padded"]


class PackedCausalAttention:
    """Training backend: no KV cache; each packed sequence attends causally to itself.

    The metadata is the same object the engine builds (qo_indptr, q_lens_cpu); slots and pages are
    ignored. Heads run their training forward through it, so training and serving share every line
    of the layer code and differ only in where keys come from. The sequences run as padded batches, one
    per length bucket (`PaddedLayout`: one causal SDPA call each, no mask tensor, under 2N padded rows),
    so the ops grow with the log of the longest length, not with the number of sequences.
    """

    name = "packed"
    expands_mla = True  # no latent cache to read: MLA runs expanded (models.deepseek_mla.MLAttention._expanded)

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> None:
        return None

    @torch.compiler.disable  # bucket shapes change with every length mix: one graph break, not a recompile each
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPages | None,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        lay = padded_layout(meta)
        k, v, gqa = fused_kv(q, k, v)
        outs = [torch.nn.functional.scaled_dot_product_attention(  # per bucket (B_b, L_b, H, Dh)
            qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), is_causal=qb.shape[1] > 1, scale=scale,
            enable_gqa=gqa).transpose(1, 2) for qb, kb, vb in zip(lay.pad(q), lay.pad(k), lay.pad(v))]
        return lay.unpad(outs)  # (N, Hq, Dh)


def packed_metadata(seq_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for packed training sequences: positions restart at 0 in every sequence."""
    # Built on the host and copied without waiting (a blocking copy to a GPU waits for its queue).
    lens = torch.tensor(list(seq_lens), dtype=torch.long)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens, 0)])
    total = int(sum(seq_lens))
    positions = torch.arange(total) - torch.repeat_interleave(indptr[:-1], lens, output_size=total)
    indptr, lens, positions = (t.to(device, non_blocking=True) for t in (indptr.to(torch.int32), lens.to(torch.int32),
                                                                          positions))
    return AttentionMetadata(
        positions=positions.long(), slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
        qo_indptr=indptr, kv_lens=lens, page_table=torch.zeros(len(seq_lens), 0, dtype=torch.int32, device=device),
        page_size=1, q_lens_cpu=list(seq_lens), kv_lens_cpu=list(seq_lens), paged=False,
    )
