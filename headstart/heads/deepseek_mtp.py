"""DeepSeek-V3's MTP module: embedding first, both inputs normalised, one decoder block of the
target's own kind, a shared head.

    x = eh_proj(cat(enorm(emb(t)), hnorm(h)))    the embedding at position 0 is zeroed (as DeepSeek);
                                                 h pre-norm, or with postnorm_features the target's
                                                 output after its final norm (what DeepSeek MTP
                                                 loaders in vLLM / SGLang feed)
    y = block(x)                                 a decoder layer of the target's family
    logits = shared_head.head(shared_head.norm(y))   the head is the target's lm_head (shared)

Multi-step drafting reuses the one module, feeding y back as h. Checkpoint names follow DeepSeek's
(`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the block under `layers.0`).
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.errors import AssetError
from headstart.heads.base import (
    HeadConfig,
    SharedVocabHead,
    init_from_last_layers,
    init_fusion_as_identity,
    target_state_rms,
)
from headstart.models.llama import SUPPORTED_MODEL_TYPES, LlamaForCausalLM
from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.decoder import DecoderLayer
from headstart.nn.linear import Linear
from headstart.nn.norm import RMSNorm


class _SharedHead(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(d, eps)


class DeepSeekMTPHead(SharedVocabHead):
    def __init__(self, cfg: HeadConfig, target: LlamaForCausalLM) -> None:
        super().__init__(cfg, target)
        if target.config.model_type not in SUPPORTED_MODEL_TYPES:
            raise AssetError(f"deepseek_mtp: no decoder block for target family {target.config.model_type!r}")
        d, eps = cfg.hidden_size, target.config.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.rotary = self.make_rotary(target)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer_config(target), self.rotary) for _ in range(cfg.num_layers))
        self.shared_head = _SharedHead(d, eps)

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
