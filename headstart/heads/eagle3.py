"""EAGLE-3: fused features from three target layers, a 2d-wide attention input, a reduced vocabulary.

    f = fc(cat(a_low, a_mid, a_high))                      (N, 3d) -> (N, d); own outputs skip fc
    x = cat(embed_norm(emb(t)), hidden_norm(f))            (N, 2d) attention input
    y = f + attn(x);  y = y + mlp(post_norm(y))            residual stream is f (not the embedding)
    logits = lm_head_draft(norm(y))                        (N, V_draft); target id = i + d2t[i]

EAGLE-3.1 flags (heads.base.EAGLE31_FLAGS, speculators' Eagle3DraftModel semantics):
    norm_before_fc:       f = fc(input_norm(cat(a)))               one norm over (N, 3d)
    fc_norm:              f = fc(cat(fc_norm_i(a_i)))              one norm per aux state
    norm_before_residual: y = hidden_norm(f) + attn(x)             the residual is the normed f
    norm_output:          the head's output is norm(y) (the logits read it as is), so the next draft
                          step, in the engine and in the TTT unroll, is fed the post-norm state

Names map to SGLang's LlamaForCausalLMEagle3 as embed_norm -> midlayer.input_layernorm,
hidden_norm -> midlayer.hidden_norm, layers.0 -> midlayer.
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.heads.base import TEMPER, DraftHead, copy_layer
from headstart.heads.config import HeadConfig
from headstart.heads.vocab import draft_to_target
from headstart.models.llama import LlamaForCausalLM
from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.decoder import DecoderLayer
from headstart.nn.linear import Linear
from headstart.nn.norm import RMSNorm


class Eagle3Head(DraftHead):
    def __init__(self, cfg: HeadConfig, target: LlamaForCausalLM) -> None:
        super().__init__(cfg, target)
        d, eps = cfg.hidden_size, target.config.rms_norm_eps
        a = len(cfg.aux_layer_ids)
        self.fc = Linear(a * d, d, bias=False)
        self.input_norm = RMSNorm(a * d, eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(d, eps) for _ in range(a)) if cfg.fc_norm else None
        self.embed_norm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.rotary = self.make_rotary(target)
        first = cfg.layer_config(target, input_norm=False, attn_in_features=2 * d)
        self.layers = nn.ModuleList(
            DecoderLayer(first if i == 0 else cfg.layer_config(target), self.rotary) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(d, eps)
        vocab = target.config.vocab_size
        vd = cfg.draft_vocab_size or vocab
        self.lm_head = Linear(d, vd, bias=False) if cfg.draft_vocab_size else None
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool) if vd == vocab else
                             torch.zeros(vocab, dtype=torch.bool))

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary and re-initialise the draft lm_head from the target's rows."""
        if d2t.numel() != self.draft_vocab_size or int(t2d.sum()) != d2t.numel():
            raise ValueError(f"maps do not describe a {self.draft_vocab_size}-token draft vocabulary")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if self.lm_head is not None:
            ids = draft_to_target(torch.arange(self.draft_vocab_size, device=d2t.device), d2t)
            with torch.no_grad():
                self.lm_head.weight.copy_(self.target.lm_head.weight[ids.to(self.target.lm_head.weight.device)])

    def target_features(self, hidden: torch.Tensor | None, aux: torch.Tensor | None = None) -> torch.Tensor:
        if aux is None:
            raise ValueError(f"eagle3 needs the hidden states entering layers {self.config.aux_layer_ids}")
        n, a, d = aux.shape  # (N, A, d)
        x = aux.reshape(n, a * d).to(self.fc.weight.dtype)  # (N, A d)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(a, dim=-1))], dim=-1)
        return self.fc(x)

    def forward_hidden(self, tokens: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata,
                       caches: list[KVPages] | None, backend: AttentionBackend) -> torch.Tensor:
        e = self.embed_norm(self.embed(tokens))
        f = self.hidden_norm(features).to(e.dtype)
        x = torch.cat([e, f], dim=-1)  # (N, 2d)
        residual = f if self.config.norm_before_residual else features
        y = self.layers[0](x, meta, caches[0] if caches is not None else None, backend, residual=residual)
        for j, layer in enumerate(self.layers[1:], start=1):
            y = layer(y, meta, caches[j] if caches is not None else None, backend)
        return self.norm(y) if self.config.norm_output else y

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(N, d) -> (N, V_draft) logits over the draft vocabulary (the full vocab without one); with
        norm_output `h` is already normed."""
        head = self.lm_head if self.lm_head is not None else self.target.lm_head
        return head(h if self.config.norm_output else self.norm(h)).float()

    def logit_projection(self) -> tuple | None:
        """(pre, weight) with compute_logits(h) == linear(pre(h), weight), where the projection is the head's
        own draft lm_head (train.losses.FusedChunks takes the loss's gradient in its forward pass); else None."""
        if self.lm_head is None:
            return None
        return (lambda h: h) if self.config.norm_output else self.norm, self.lm_head.weight

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_to_target(draft_ids, self.d2t)

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        """The head starts as a softened copy of the target's own next-token prediction:
        - fc passes the deepest aux state through (f = a_high, the identity on its block, the other
          aux blocks at zero), so the residual stream is a target state of the target's size;
        - the first layer's MLP and post-attention norm come from the target's last layer; its q/k/v
          read 2d here, so they keep their random init, and its o_proj starts at zero (random
          attention would add noise of the stream's size);
        - the final norm is the target's at TEMPER (the logits at 1/4 of their size), the draft
          lm_head the target's rows.
        Measured on SmolLM2 (benchmarks/init.py --head eagle3, 12 equal steps): held-out KL at the
        start 7.19 nats (log V = 10.80), after the steps 4.28 and top-1 0.127. The previous init
        (random fc, target norm): 14.77 at the start, 5.45 / 0.062 after; fc_high alone: 11.21, then
        4.53 / 0.116; tempered alone 7.93, then 5.08 / 0.079; all random: 10.77, then 5.99 / 0.079.
        (Measured with the EAGLE-3.1 flags off; the input norms start at one.)"""
        copy_layer(self.layers[0], target.model.layers[-1])
        d = self.config.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, -d:] = torch.eye(d, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
            self.layers[0].self_attn.o_proj.weight.zero_()
            self.norm.weight.copy_(target.model.norm.weight * TEMPER)
        if self.lm_head is not None and int(self.t2d.sum()) == self.draft_vocab_size:
            self.set_vocab_maps(self.d2t.clone(), self.t2d.clone())
