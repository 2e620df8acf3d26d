"""DeepSeek-V3's MTP module: embedding first, both inputs normalised, one decoder block of the
target's own kind, a shared head.

    x = eh_proj(cat(enorm(emb(t)), hnorm(h)))    the embedding at position 0 is zeroed (as DeepSeek);
                                                 h pre-norm, or with postnorm_features the target's
                                                 output after its final norm (what DeepSeek MTP
                                                 loaders in vLLM / SGLang feed)
    y = block(x)                                 a decoder layer of the target's family: on a
                                                 DeepSeek target its own MLA block, with the MoE MLP
                                                 the target routes at the MTP layer's index
                                                 (DeepSeek-V3's) unless dense_block
    logits = shared_head.head(shared_head.norm(y))   the head is the target's lm_head (shared)

Multi-step drafting reuses the one module, feeding y back as h. Checkpoint names follow DeepSeek's
(`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the block under `layers.0`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from headstart.errors import AssetError
from headstart.heads.base import SharedVocabHead, init_from_last_layers, init_fusion_as_identity, target_state_rms
from headstart.heads.config import HeadConfig
from headstart.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM
from headstart.models.llama import SUPPORTED_MODEL_TYPES, LlamaForCausalLM
from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.decoder import DecoderLayer
from headstart.nn.linear import Linear
from headstart.nn.norm import RMSNorm
from headstart.nn.rope import RotaryEmbedding


class _SharedHead(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(d, eps)


class DeepSeekMTPHead(SharedVocabHead):
    def __init__(self, cfg: HeadConfig, target: LlamaForCausalLM) -> None:
        super().__init__(cfg, target)
        d, eps = cfg.hidden_size, target.config.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        if isinstance(target, DeepseekForCausalLM):
            t = target.config
            block = dataclasses.replace(t, n_routed_experts=None) if cfg.dense_block else t
            self.rotary = RotaryEmbedding(t.rope)
            self.layers = nn.ModuleList(DeepseekDecoderLayer(block, t.num_hidden_layers + i, self.rotary)
                                        for i in range(cfg.num_layers))
            self.mla_dim: int | None = t.latent_dim
        elif target.config.model_type in SUPPORTED_MODEL_TYPES:
            if cfg.dense_block:
                raise AssetError("deepseek_mtp: dense_block applies to DeepSeek targets (whose block may be MoE)")
            self.rotary = self.make_rotary(target)
            self.layers = nn.ModuleList(DecoderLayer(cfg.layer_config(target), self.rotary)
                                        for _ in range(cfg.num_layers))
            self.mla_dim = None
        else:
            raise AssetError(f"deepseek_mtp: no decoder block for target family {target.config.model_type!r}")
        self.shared_head = _SharedHead(d, eps)

    # An MLA block caches one latent row per token (see headstart.models.deepseek_mla).
    @property
    def cache_shared(self) -> bool:  # type: ignore[override]
        return self.mla_dim is not None

    @property
    def cache_heads(self) -> int:
        return 1 if self.mla_dim is not None else super().cache_heads

    @property
    def cache_head_dim(self) -> int:
        return self.mla_dim if self.mla_dim is not None else super().cache_head_dim

    def target_features(self, hidden: torch.Tensor | None, aux: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            raise ValueError("deepseek_mtp needs the target's last hidden state")
        return self.target.norm(hidden) if self.config.postnorm_features else hidden

    def forward_hidden(self, tokens: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata,
                       caches: list[KVPages] | None, backend: AttentionBackend) -> torch.Tensor:
        e = self.embed(tokens)
        e = e.masked_fill((meta.positions == 0).unsqueeze(-1), 0.0)  # DeepSeek zeroes position 0
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(features).to(e.dtype)], dim=-1))
        for j, layer in enumerate(self.layers):
            x = layer(x, meta, caches[j] if caches is not None else None, backend)
        return x

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(self.shared_head.norm(h))

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        init_from_last_layers(self.layers, target)
        # eh_proj starts as a scaled identity on the normalised h: the copied block reads a residual
        # stream of the target's size (see EagleHead.init_from_target for the measurement).
        init_fusion_as_identity(self.eh_proj, target_state_rms(target))
        with torch.no_grad():
            self.shared_head.norm.weight.copy_(target.model.norm.weight)
