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
    """Packed rows (N, ...) laid out as a padded batch (B, L, ...), L the longest sequence: one attention call
    runs every sequence, whatever their number. Built once per micro-batch (`padded_layout`)."""

    gather: torch.Tensor  # (B, L) packed row of each padded slot; N (a zero row appended) for padding
    scatter: torch.Tensor  # (N,) flat padded slot of each packed row
    batch: int
    length: int

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, L, ...); padding slots hold zeros."""
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.gather]

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (N, ...)."""
        return y.reshape(self.batch * self.length, *y.shape[2:])[self.scatter]

    @classmethod
    def of(cls, lens: list[int], device: torch.device | str) -> PaddedLayout:
        """The layout of rows packed in sequences of `lens` (some may be empty). Built on the host from the
        lengths and copied without waiting: no device sync (a blocking copy to a GPU waits for its queue)."""
        n_rows = torch.tensor(list(lens), dtype=torch.long)
        b, n, length = n_rows.numel(), int(sum(lens)), max(max(lens, default=1), 1)
        starts = torch.cumsum(n_rows, 0) - n_rows  # (B,)
        col = torch.arange(length)
        inside = col[None, :] < n_rows[:, None]  # (B, L)
        gather = torch.where(inside, starts[:, None] + col[None, :], torch.full_like(inside, n, dtype=torch.long))
        seq = torch.repeat_interleave(torch.arange(b), n_rows, output_size=n)
        local = torch.arange(n) - starts[seq]
        return cls(gather.to(device, non_blocking=True), (seq * length + local).to(device, non_blocking=True), b,
                   length)


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
    of the layer code and differ only in where keys come from. The sequences run as one padded batch
    (one causal SDPA call, no mask tensor), so the ops do not grow with the number of sequences.
    """

    name = "packed"
    expands_mla = True  # no latent cache to read: MLA runs expanded (models.deepseek.MLAttention._expanded)

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> None:
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPages | None,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        lay = padded_layout(meta)
        k, v, gqa = fused_kv(q, k, v)
        qs, ks, vs = (lay.pad(t).transpose(1, 2) for t in (q, k, v))  # (B, H, L, Dh)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=lay.length > 1, scale=scale,
                                                             enable_gqa=gqa)
        return lay.unpad(o.transpose(1, 2))  # (N, Hq, Dh)


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
        page_size=1, q_lens_cpu=list(seq_lens), kv_lens_cpu=list(seq_lens),
    )
