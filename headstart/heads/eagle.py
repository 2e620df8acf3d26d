"""EAGLE-style chain heads: `mtp` (RMSNorm restored, the scheme served at Perplexity) and `eagle1`
(the original EAGLE head). One code path; the norm flags in EAGLE_FLAGS are the only difference.

    mtp:    x = fc(cat(embed_norm(emb(t)), hidden_norm(h)))   h pre-norm
            y = decoder_layer(x)                               (with its input norm)
            logits = lm_head(final_norm(y))                    y regresses the target's pre-norm h
    eagle1: x = fc(cat(emb(t), target_norm(h))) (+ fc bias)    h post-norm (target's final norm)
            y = decoder_layer(x)                               (input norm removed)
            logits = lm_head(y)                                y regresses the post-norm h
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.heads.base import (
    DraftHead,
    SharedVocabHead,
    init_from_last_layers,
    init_fusion_as_identity,
    target_state_rms,
    zero_output_projections,
)
from headstart.heads.config import HeadConfig
from headstart.models.llama import LlamaForCausalLM
from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.decoder import DecoderLayer
from headstart.nn.linear import Linear
from headstart.nn.norm import RMSNorm


def _feature_scale(head: DraftHead, target: LlamaForCausalLM) -> float:
    """Target state RMS / RMS of the features as they enter fc (after the head's hidden norm)."""
    state = target_state_rms(target)
    probe = torch.ones(1, head.config.hidden_size, dtype=target.model.embed_tokens.weight.dtype,
                       device=target.model.embed_tokens.weight.device) * state
    with torch.no_grad():
        f = head.target_features(probe)
        f = head.hidden_norm(f) if head.hidden_norm is not None else f
    return state / max(float(f.float().pow(2).mean().sqrt()), 1e-6)


class EagleHead(SharedVocabHead):
    def __init__(self, cfg: HeadConfig, target: LlamaForCausalLM) -> None:
        super().__init__(cfg, target)
        d, eps = cfg.hidden_size, target.config.rms_norm_eps
        self.embed_norm = RMSNorm(d, eps) if cfg.embed_norm else None
        self.hidden_norm = RMSNorm(d, eps) if cfg.hidden_norm else None
        self.fc = Linear(2 * d, d, bias=cfg.fc_bias)  # input: cat(embedding, features), embedding first
        self.rotary = self.make_rotary(target)
        layer_cfg = cfg.layer_config(target)
        self.layers = nn.ModuleList(
            # Only the first layer drops its input norm in EAGLE-1 (its input is already mixed by fc).
            DecoderLayer(layer_cfg if (i > 0 or cfg.layer_input_norm) else
                         cfg.layer_config(target, input_norm=False), self.rotary)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(d, eps) if cfg.final_norm else None

    def target_features(self, hidden: torch.Tensor | None, aux: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            raise ValueError(f"{self.config.head_type} needs the target's last hidden state")
        return self.target.norm(hidden) if self.config.postnorm_features else hidden

    def forward_hidden(self, tokens: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata,
                       caches: list[KVPages] | None, backend: AttentionBackend) -> torch.Tensor:
        e = self.embed(tokens)  # (N, d)
        if self.embed_norm is not None:
            e = self.embed_norm(e)
        f = self.hidden_norm(features) if self.hidden_norm is not None else features
        x = self.fc(torch.cat([e, f.to(e.dtype)], dim=-1))  # (N, 2d) -> (N, d)
        for j, layer in enumerate(self.layers):
            x = layer(x, meta, caches[j] if caches is not None else None, backend)
        return x

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(self.norm(h) if self.norm is not None else h)

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        """Decoder layers from the target's last layers, final norm from the target's, and fc set so
        that x = s * features at the start (embedding half zero, feature half s * identity), with s
        chosen so x has the size of the target's residual stream (SmolLM2: RMS ~33 against ~1 for
        the normalised features): the copied layer then adds updates of the size it was trained to
        add. Measured (benchmarks/init.py, 12 equal steps): held-out KL at the start 8.3 nats
        (unscaled: 16.1, above log V = 10.8), after the steps 4.9 (unscaled 6.1), top-1 0.085 (0.038)."""
        init_from_last_layers(self.layers, target)
        if self.norm is None:
            # eagle1: no norm before the lm_head, so the layer's output is read as it is; the copied
            # layer's updates (sized for the target's RMS ~33 stream) would swamp it. Its output
            # projections start at zero: the head starts as lm_head(norm(h)), the target's own
            # prediction one position back (held-out KL below log V).
            init_fusion_as_identity(self.fc)
            zero_output_projections(self.layers)
        else:
            init_fusion_as_identity(self.fc, _feature_scale(self, target))
        if self.norm is not None:
            with torch.no_grad():
                self.norm.weight.copy_(target.model.norm.weight)
