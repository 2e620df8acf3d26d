"""A small standalone Llama-family LM with the target's tokenizer, for draft-target decoding.

Built from a config (its own width, embeddings and lm_head) or as the target's first `num_layers`
layers sharing the target's (frozen) embedding and lm_head. It has its own KV cache in the engine
and sees tokens only; `features` is ignored.
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.heads.base import TEMPER, DraftHead, PackedBatch, Shifted, copy_layer
from headstart.heads.config import HeadConfig
from headstart.models.llama import LlamaForCausalLM
from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.decoder import DecoderLayer
from headstart.nn.linear import Linear
from headstart.nn.norm import RMSNorm


class DraftLM(DraftHead):
    def __init__(self, cfg: HeadConfig, target: LlamaForCausalLM) -> None:
        super().__init__(cfg, target)
        d, eps, vocab = cfg.hidden_size, target.config.rms_norm_eps, target.config.vocab_size
        shared = cfg.share_target_embeddings
        if shared and d != target.config.hidden_size:
            raise ValueError(f"draft_lm shares the target's embeddings, so hidden_size must be "
                             f"{target.config.hidden_size}, got {d}")
        self.embed_tokens = None if shared else nn.Embedding(vocab, d)
        self.lm_head = None if shared else Linear(d, vocab, bias=False)
        self.rotary = self.make_rotary(target)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer_config(target), self.rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, eps)

    @property
    def consumes(self) -> dict:
        return {"last_hidden": False, "aux_layers": []}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens) if self.embed_tokens is not None else self.target.embed(tokens)

    def target_features(self, hidden: torch.Tensor | None, aux: torch.Tensor | None = None) -> torch.Tensor:
        return torch.zeros(0)

    def forward_hidden(self, tokens: torch.Tensor, features: torch.Tensor | None, meta: AttentionMetadata,
                       caches: list[KVPages] | None, backend: AttentionBackend) -> torch.Tensor:
        x = self.embed(tokens)
        for j, layer in enumerate(self.layers):
            x = layer(x, meta, caches[j] if caches is not None else None, backend)
        return x

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self.target.lm_head
        return head(self.norm(h)).float()

    def train_forward(self, batch: PackedBatch) -> tuple[torch.Tensor, Shifted]:
        """A plain causal LM over the packed tokens: row i predicts t_{i+1}, whose target distribution
        is p_i (target row i), supervised iff loss_mask[i+1] in the same sequence."""
        from headstart.nn.attention import PackedCausalAttention, packed_metadata

        ids = batch.input_ids
        meta = packed_metadata(list(batch.seq_lens), device=ids.device)
        h = self.forward_hidden(ids, None, meta, None, PackedCausalAttention())
        n = ids.numel()
        rows = torch.arange(n)
        lens = torch.tensor(batch.seq_lens)
        last = torch.zeros(n, dtype=torch.bool)
        last[lens.cumsum(0) - 1] = True  # a sequence's last row has no next token
        nxt = (rows + 1).clamp(max=n - 1)
        mask = batch.loss_mask if batch.loss_mask is not None else torch.ones(n, dtype=torch.long)
        token_mask = torch.where(last, 0, mask.long()[nxt])
        next_tokens = torch.where(last, -100, ids[nxt])
        return h, Shifted(ids, rows, rows, next_tokens, token_mask, list(batch.seq_lens))

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        """The target's first layers and its final norm at TEMPER (and embeddings when the width
        matches): the target cut after its first layers predicts confidently and often wrongly, so
        its logits start at 1/4 of their size. Measured on SmolLM2 (benchmarks/init.py --head
        draft_lm, one layer, 12 equal steps): held-out KL at the start 6.75 nats (log V = 10.80)
        against 14.34 with the norm at full size; after the steps 5.37 and top-1 0.142 against 7.63
        and 0.097. A draft with all the target's layers is the target and keeps its norm."""
        for i, layer in enumerate(self.layers):
            if i < len(target.model.layers):
                copy_layer(layer, target.model.layers[i])
        whole = len(self.layers) >= len(target.model.layers)  # every layer copied: the target itself
        with torch.no_grad():
            if self.norm.weight.shape == target.model.norm.weight.shape:
                self.norm.weight.copy_(target.model.norm.weight * (1.0 if whole else TEMPER))
