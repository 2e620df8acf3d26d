"""One pre-norm transformer decoder layer (attention + gated MLP), shared by targets and heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from headstart.nn.attention import Attention, AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.mlp import GatedMLP
from headstart.nn.norm import RMSNorm
from headstart.nn.parallel import SINGLE, TensorParallel
from headstart.nn.rope import RotaryEmbedding


@dataclass(kw_only=True)
class DecoderLayerConfig:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-6
    act: str = "silu"
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    mlp_bias: bool = False
    o_bias: bool = False  # o_proj bias (Llama / Qwen3 targets with attention_bias)
    input_norm: bool = True  # EAGLE-1 heads drop the first layer's input norm
    attn_in_features: int | None = None  # EAGLE-3 heads attend over cat(emb, h): 2·hidden


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderLayerConfig, rope: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        """tp: shard the layer over a tensor-parallel group (targets only; heads are replicated)."""
        super().__init__()
        in_features = cfg.attn_in_features or cfg.hidden
        self.input_layernorm = RMSNorm(in_features, cfg.norm_eps) if cfg.input_norm else None
        self.self_attn = Attention(
            hidden=cfg.hidden, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            rope=rope, qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps, in_features=in_features,
            o_bias=cfg.o_bias, tp=tp,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden, cfg.intermediate, cfg.act, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVPages, backend: AttentionBackend,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (N, Din) -> (N, D). `residual` defaults to x (it differs when Din != D, as in EAGLE-3)."""
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        h = (x if residual is None else residual) + self.self_attn(h, meta, cache, backend)
        return h + self.mlp(self.post_attention_layernorm(h))
