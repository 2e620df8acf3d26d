"""Multi-head Latent Attention (MLA) of the DeepSeek family (headstart.models.deepseek builds its layers from it;
the DeepSeek-MTP head reuses those layers).

Queries come from a (LoRA-compressed, q_lora_rank) or a plain projection; keys and values
from one compressed latent c (kv_lora_rank, normalised) plus a rope key k_pe shared by every head
(qk_rope_head_dim, decoupled RoPE: interleaved pairs, YaRN with its mscale correction of the
softmax scale). The engine runs the *absorbed* form, so the paged cache holds per token and layer
only [c, k_pe] (kv_lora_rank + qk_rope_head_dim values: DeepSeek-V3 576, V2-Lite 576, against
2 x 128 heads x 192/128 = 40,960 (V3) for expanded K/V: 71x fewer bytes), one tensor written as
both the keys and the values of a single KV head:
- the nope part of each query is taken into the latent space through W_UK (kv_b_proj's key rows):
  q_lat = q_nope W_UK, so q_lat . c = q_nope . k_nope;
- attention runs with q = [q_lat, q_pe] against k = [c, k_pe] and v = the same [c, k_pe]; the
  first kv_lora_rank columns of the output are the attention-weighted latent, and W_UV (kv_b_proj's
  value rows) takes it to each head's value space before o_proj.
It is exactly HF's expanded computation reordered (the tests compare logits in fp32). Training and a step of
whole prompts (nothing cached before them) run MLA expanded instead, as serving engines prefill: per-head keys
and values from kv_b_proj, qk_head_dim + v_head_dim per key (192 + 128 against 576 + 512), plain MHA for
the fused kernels; the prompt's latent rows still go to the cache for decode. With the CPU kernels on, the
engine prefills absorbed too (a token's bits must not depend on its step). With the
engine's CPU kernels (`enable_cpu_kernels`) the per-head W_UK / W_UV products run as one row-invariant
Linear per head, so a token's bits do not depend on what shares its step (greedy speculation equals greedy
decoding); training (autograd) uses batched einsums.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages, PackedCausalAttention
from headstart.nn.linear import Linear, init_like_linear, weight_version
from headstart.nn.norm import RMSNorm
from headstart.nn.rope import RotaryEmbedding


class KVUpProjection(nn.Module):
    """kv_b_proj's weight (H x (qk_nope + v), kv_lora_rank): W_UK and W_UV of the absorbed form. Never
    called as a Linear (the expanded keys and values are never formed)."""

    def __init__(self, rank: int, heads: int, nope: int, v: int) -> None:
        super().__init__()
        self.heads, self.nope, self.v = heads, nope, v
        self.weight = nn.Parameter(torch.empty(heads * (nope + v), rank))
        init_like_linear(self.weight)  # a head built without the target's weights starts from this

    def keys(self) -> torch.Tensor:  # (H, nope, rank)
        return self.weight.view(self.heads, self.nope + self.v, -1)[:, : self.nope]

    def values(self) -> torch.Tensor:  # (H, v, rank)
        return self.weight.view(self.heads, self.nope + self.v, -1)[:, self.nope:]


class MLAttention(nn.Module):
    """Multi-head Latent Attention in the absorbed form over the latent cache (module docstring)."""

    def __init__(self, *, hidden_size: int, num_attention_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rms_norm_eps: float,
                 attention_bias: bool, softmax_scale: float, rope: RotaryEmbedding) -> None:
        """Sizes as DeepseekConfig names them (DeepseekDecoderLayer passes its fields); softmax_scale with
        YaRN's mscale correction (DeepseekConfig.softmax_scale)."""
        super().__init__()
        d, h = hidden_size, num_attention_heads
        self.num_heads = h
        self.nope, self.rope_dim, self.rank, self.v = qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank:
            self.q_a_proj = Linear(d, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, rms_norm_eps)
            self.q_b_proj = Linear(q_lora_rank, h * qk_head_dim, bias=False)
        else:
            self.q_proj = Linear(d, h * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)  # [c, k_pe]
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, rms_norm_eps)
        self.kv_b_proj = KVUpProjection(kv_lora_rank, h, qk_nope_head_dim, v_head_dim)
        self.o_proj = Linear(h * v_head_dim, d, bias=attention_bias)
        self.rope = rope
        self.scale = softmax_scale

    def own_cpu_kernels(self, rowwise: bool, max_rows: int | None) -> list[str]:
        """Per-head Linears of W_UK (nope -> rank) and W_UV (rank -> v), copies of kv_b_proj's rows with the
        CPU kernels, used by no-grad forwards while kv_b_proj's weight is unchanged (not registered: derived)."""
        w = self.kv_b_proj.weight
        uk, uv = [], []
        for keys, values in zip(self.kv_b_proj.keys(), self.kv_b_proj.values()):  # (nope, rank), (v, rank)
            a, b = Linear(self.nope, self.rank, bias=False), Linear(self.rank, self.v, bias=False)
            a.to(w.device, w.dtype).weight.data.copy_(keys.t())
            b.to(w.device, w.dtype).weight.data.copy_(values)
            uk.append(a.requires_grad_(False))
            uv.append(b.requires_grad_(False))
        got = [lin.enable_cpu_kernels(rowwise, max_rows) for lin in uk + uv]
        object.__setattr__(self, "_absorbed", (weight_version(w), uk, uv))
        object.__setattr__(self, "_kernel_rows", 1 << 62 if max_rows is None else max_rows)
        return got

    def _per_head(self) -> tuple[list[Linear], list[Linear]] | None:
        ab = self.__dict__.get("_absorbed")
        if ab is None or torch.is_grad_enabled() or ab[0] != weight_version(self.kv_b_proj.weight):
            return None
        return ab[1], ab[2]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVPages,
                backend: AttentionBackend) -> torch.Tensor:
        n, h = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(n, h, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        q_pe, k_pe = self.rope(q_pe, k_pe.view(n, 1, self.rope_dim), meta.positions, meta.step_cache)
        if getattr(backend, "expands_mla", False):
            return self._expanded(q_nope, q_pe, c, k_pe, meta, cache, backend)
        latent = torch.cat([c.unsqueeze(1), k_pe], dim=-1)  # (N, 1, rank + rope): the cached row
        per_head = self._per_head()
        if meta.paged and _fresh_prefill(meta) and (per_head is None or n > self._kernel_rows):
            # Prompts with nothing cached before them, on the engine's pages (a training step's cache, a TTT
            # list or none, is its backend's to fill): the latent rows go to the cache for decode, and the
            # prompt attends to itself expanded, as serving engines prefill. Not where the row-invariant
            # kernels take the step (a batch-invariant engine): a prompt token's bits would then depend on
            # whether its step was a prefill.
            for pages in {id(t): t for t in cache}.values():
                pages.view(-1, 1, pages.shape[-1]).index_copy_(0, meta.slot_mapping, latent.to(pages.dtype))
            return self._expanded(q_nope, q_pe, c, k_pe, meta, None, _PREFILL)
        if per_head is not None:  # row-invariant kernels, one Linear per head
            q_lat = torch.stack([lin(q_nope[:, j]) for j, lin in enumerate(per_head[0])], dim=1)
        else:
            q_lat = torch.einsum("nhd,hdr->nhr", q_nope, self.kv_b_proj.keys())  # q_nope . k_nope = q_lat . c
        query = torch.cat([q_lat, q_pe], dim=-1)  # (N, H, rank + rope)
        o = backend.forward(query, latent, latent, cache, meta, self.scale)[..., : self.rank]  # (N, H, rank)
        if per_head is not None:
            out = torch.stack([lin(o[:, j]) for j, lin in enumerate(per_head[1])], dim=1)
        else:
            out = torch.einsum("nhr,hvr->nhv", o, self.kv_b_proj.values())  # (N, H, v)
        return self.o_proj(out.reshape(n, h * self.v))

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                  meta: AttentionMetadata, cache: Any, backend: AttentionBackend) -> torch.Tensor:
        """MLA as written, for the training backends (no paged cache: prefill-shaped, every key computed
        once): per-head keys (nope + rope) and values from kv_b_proj, so attention reads qk_head_dim +
        v_head_dim per key instead of the latent's rank + rope twice (192 + 128 against 576 + 512 for
        DeepSeek-V2/V3), and the heads are plain MHA for the fused kernels. Decode keeps the absorbed form
        over the latent cache."""
        n, h = c.shape[0], self.num_heads
        kv = torch.nn.functional.linear(c, self.kv_b_proj.weight).view(n, h, self.nope + self.v)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)  # (N, H, nope), (N, H, v)
        query = torch.cat([q_nope, q_pe], dim=-1)  # (N, H, nope + rope)
        keys = torch.cat([k_nope, k_pe.expand(n, h, self.rope_dim)], dim=-1)
        width = max(query.shape[-1], self.v)  # fused kernels take one head width: zeros change no score or value

        def fit(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t

        o = backend.forward(fit(query), fit(keys), fit(v), cache, meta, self.scale)[..., : self.v]  # (N, H, v)
        return self.o_proj(o.reshape(n, h * self.v))


_PREFILL = PackedCausalAttention()


def _fresh_prefill(meta: AttentionMetadata) -> bool:
    """A step of whole prompts only: each sequence's keys are exactly its new rows (no cached prefix, no chunk
    before, no tree mask), at least one with more than one row."""
    return meta.custom_masks is None and meta.q_lens_cpu == meta.kv_lens_cpu and max(meta.q_lens_cpu, default=0) > 1


__all__ = ["KVUpProjection", "MLAttention"]
