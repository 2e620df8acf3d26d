"""What every draft head shares: the base class, the frozen target parts and the shift by one (the
typed config is in config.py, the native checkpoint in checkpoint.py; docs/architecture.md).

Shift by one, implemented once (`shift_for_head`). For a sequence t_0..t_{T-1} with target hidden
states h_0..h_{T-1}, head input row i is (h_i, t_{i+1}) at position i, for i = 0..T-2; its targets
are h_{i+1} (features) and p_{i+1} = softmax(lm_head(norm(h_{i+1}))), and the token it predicts is
t_{i+2}, supervised iff loss_mask[i+2]. Worked example, T = 4:

    tokens    t0  t1  t2  t3          row 0: (h0, t1) @ pos 0 -> predicts t2, feature target h1
    hidden    h0  h1  h2  h3          row 1: (h1, t2) @ pos 1 -> predicts t3, feature target h2
    loss_mask m0  m1  m2  m3          row 2: (h2, t3) @ pos 2 -> no t4: token mask 0, target h3

Frozen target parts (embedding, final norm, lm_head) are referenced, never registered as the
head's submodules, so they are neither in `trainable_parameters()` nor in the saved checkpoint.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from headstart.heads.config import HeadConfig
from headstart.models.llama import LlamaForCausalLM
from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.rope import RotaryEmbedding


@dataclass
class PackedBatch:
    """Packed training sequences as precompute stores them (docs/architecture.md, shards)."""

    input_ids: torch.Tensor  # (N,) long
    seq_lens: list[int]
    hidden: torch.Tensor | None = None  # (N, d) pre-norm last hidden state
    aux_hidden: torch.Tensor | None = None  # (N, A, d) hidden states entering the aux layers
    loss_mask: torch.Tensor | None = None  # (N,) 0/1
    # fp8 shards read as they are stored: hidden / aux_hidden are float8_e4m3fn and these their per-token
    # fp32 scales, dequantised where the step runs (train.module.HeadModule.losses). None: already whole.
    hidden_scale: torch.Tensor | None = None  # (N,)
    aux_scale: torch.Tensor | None = None  # (N, A)

    def pin_memory(self) -> PackedBatch:
        """Every tensor in page-locked memory: the DataLoader's pin_memory thread calls this (it passes
        an object without the method through as it is), so the step's host-to-device copies are async."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).pin_memory()
                                            for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


@dataclass
class Shifted:
    """Head inputs and targets after the shift by one (see the module docstring)."""

    tokens: torch.Tensor  # (M,) t_{i+1}
    src_rows: torch.Tensor  # (M,) packed row i: where h_i (the input features) comes from
    target_rows: torch.Tensor  # (M,) packed row i+1: h_{i+1}, p_{i+1}
    next_tokens: torch.Tensor  # (M,) t_{i+2}, or -100 where there is none
    token_mask: torch.Tensor  # (M,) loss_mask[i+2] (0 where t_{i+2} does not exist)
    seq_lens: list[int]  # T-1 rows per sequence (sequences with T < 2 are dropped)


def shift_for_head(input_ids: torch.Tensor, seq_lens: list[int], loss_mask: torch.Tensor | None = None) -> Shifted:
    # Indices on the host from the lengths (vectorised: no loop over sequences, no device sync); the
    # token and mask gathers run where the batch lives.
    lens = torch.tensor(list(seq_lens), dtype=torch.long)
    keep = lens >= 2
    if not bool(keep.any()):
        raise ValueError("no sequence has at least 2 tokens: nothing to shift")
    m_lens, m_starts = (lens - 1)[keep], (torch.cumsum(lens, 0) - lens)[keep]
    total = int(m_lens.sum())

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(t, m_lens, output_size=total)

    local = torch.arange(total) - per_row(torch.cumsum(m_lens, 0) - m_lens)  # row within its shifted sequence
    src = per_row(m_starts) + local
    has_next = local < per_row(m_lens) - 1  # row i has a token t_{i+2} to predict
    ahead = torch.where(has_next, src + 2, src)  # t_{i+2}'s packed row (a harmless valid row where there is none)
    dev = input_ids.device
    toks = input_ids[(src + 1).to(dev, non_blocking=True)].long()
    nxt = torch.where(has_next.to(dev, non_blocking=True), input_ids[ahead.to(dev, non_blocking=True)].long(), -100)
    if loss_mask is None:
        mask = has_next.long()
    else:
        mask = loss_mask[ahead.to(loss_mask.device)].long() * has_next.to(loss_mask.device)
    return Shifted(toks, src, src + 1, nxt, mask, m_lens.tolist())


@dataclass
class TargetParts:
    """References to the frozen target pieces a head reads through (never the head's own state)."""

    model: LlamaForCausalLM

    @property
    def embed(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    @property
    def norm(self) -> nn.Module:
        return self.model.model.norm

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    @property
    def vocab_size(self) -> int:
        """The target's whole vocabulary (its lm_head may hold a tensor-parallel share of the rows)."""
        return self.model.config.vocab_size


class DraftHead(nn.Module, abc.ABC):
    """Base class. Subclasses implement `target_features`, `forward_hidden`, `compute_logits`."""

    def __init__(self, cfg: HeadConfig, target: LlamaForCausalLM) -> None:
        super().__init__()
        self.config = cfg
        object.__setattr__(self, "target", TargetParts(target))  # not registered: frozen, not ours

    @contextlib.contextmanager
    def reading(self, parts: TargetParts) -> Iterator[DraftHead]:
        """Read the frozen pieces from `parts` meanwhile: training fits a head against whole copies of
        the embedding and lm_head, while the engine validates it against the tensor-parallel target
        (whose embedding and lm_head are collectives over its group)."""
        own = self.target
        object.__setattr__(self, "target", parts)
        try:
            yield self
        finally:
            object.__setattr__(self, "target", own)

    # What precompute must capture for this head.
    @property
    def consumes(self) -> dict[str, Any]:
        return {"last_hidden": True, "aux_layers": list(self.config.aux_layer_ids or [])}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def kv_layers(self) -> int:
        """Decoder layers that need a KV cache in the engine (0 for Medusa)."""
        return self.config.num_layers

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def plan(self, meta: AttentionMetadata, backend: AttentionBackend) -> None:
        """Let the backend prepare this step for the head's attention shape (once per step)."""
        backend.plan(meta, self.config.num_attention_heads, self.cache_heads, self.cache_head_dim, self.dtype)

    # The paged KV cache per decoder layer: cache_heads x cache_head_dim per token; keys and values
    # one tensor (an MLA block's latent) or two.
    cache_shared = False

    @property
    def cache_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def cache_head_dim(self) -> int:
        return self.config.head_dim

    def make_rotary(self, target: LlamaForCausalLM) -> RotaryEmbedding:
        return RotaryEmbedding(dataclasses.replace(target.config.rope, head_dim=self.config.head_dim))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed(tokens)

    @abc.abstractmethod
    def target_features(self, hidden: torch.Tensor | None, aux: torch.Tensor | None = None) -> torch.Tensor:
        """Target states -> the head's feature space (N, d). Own outputs are fed back unchanged."""

    @abc.abstractmethod
    def forward_hidden(self, tokens: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata,
                       caches: list[KVPages] | None, backend: AttentionBackend) -> torch.Tensor:
        """tokens (N,), features (N, d) -> the head's output hidden state (N, d), before its final norm."""

    @abc.abstractmethod
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d) -> logits (..., V or V_draft) in fp32."""

    def draft_step(self, tokens: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata,
                   caches: list[KVPages], backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """One engine step through the paged KV cache -> (hidden (N, d), logits (N, V or V_draft))."""
        self.plan(meta, backend)
        h = self.forward_hidden(tokens, features, meta, caches, backend)
        return h, self.compute_logits(h)

    def train_forward(self, batch: PackedBatch) -> tuple[torch.Tensor, Shifted]:
        """Packed sequences -> (head hidden (M, d) per shifted row, the Shifted rows)."""
        from headstart.nn.attention import PackedCausalAttention, packed_metadata

        shifted = shift_for_head(batch.input_ids, batch.seq_lens, batch.loss_mask)
        aux = batch.aux_hidden[shifted.src_rows] if batch.aux_hidden is not None else None
        hid = batch.hidden[shifted.src_rows] if batch.hidden is not None else None
        features = self.target_features(hid, aux)
        meta = packed_metadata(shifted.seq_lens, device=features.device)
        h = self.forward_hidden(shifted.tokens.to(features.device), features, meta, None, PackedCausalAttention())
        return h, shifted

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        """Start from the target's weights where shapes allow (subclasses say which)."""


class SharedVocabHead(DraftHead):
    """A head that predicts through the target's frozen lm_head (mtp, eagle1, deepseek_mtp), over
    the whole vocabulary or, with `draft_vocab_size`, over the V_d most frequent supervised tokens
    of the training split: the lm_head's rows for those tokens, gathered once (no new parameters).
    A draft step then computes V_d logits instead of V (SmolLM2: the full lm_head is ~24 % of a
    target forward). `d2t` / `t2d` are saved with the head; the proposal q lives on the draft
    vocabulary and is placed on the target's by `to_target_ids`, so the rejection rules stay exact."""

    def __init__(self, cfg: HeadConfig, target: LlamaForCausalLM) -> None:
        super().__init__(cfg, target)
        vd, vocab = cfg.draft_vocab_size, target.config.vocab_size
        if vd:
            # Until set_vocab_maps installs the chosen tokens: the first vd ids.
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[:vd] = True
            self.register_buffer("t2d", t2d)

    @property
    def has_draft_vocab(self) -> bool:
        return self.config.draft_vocab_size is not None

    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        from headstart.heads.vocab import check_vocab_maps

        if not self.has_draft_vocab:
            raise ValueError(f"this {self.config.head_type} head predicts over the full vocabulary "
                             "(head.draft_vocab_size is not set)")
        check_vocab_maps(d2t, t2d, self.config.draft_vocab_size, self.t2d.numel())
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        from headstart.heads.vocab import draft_to_target

        return draft_to_target(draft_ids, self.d2t) if self.has_draft_vocab else draft_ids

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(N, d) normalised states -> (N, V or V_d) fp32 logits through the target's frozen lm_head."""
        if not self.has_draft_vocab:
            return self.target.lm_head(x).float()
        from headstart.heads.vocab import restricted_lm_head

        lin = restricted_lm_head(self.target, self.target.lm_head, self.d2t)  # shared with the teacher's side
        return lin(x.to(lin.weight.dtype)).float()


# Where a head starts as a copy of the target's prediction at the wrong place (one position early:
# eagle3, Medusa; or a truncated target: draft_lm), its logits start at this share of their size:
# at full size the copy is confidently wrong, costing more KL than a uniform guess (benchmarks/init.md).
TEMPER = 0.25


def init_from_last_layers(layers: nn.ModuleList, target: LlamaForCausalLM) -> None:
    """Head decoder layers start as copies of the target's last layers (where shapes match)."""
    n = len(target.model.layers)
    for i, layer in enumerate(layers):
        copy_layer(layer, target.model.layers[n - len(layers) + i])


def zero_output_projections(layers: nn.ModuleList) -> None:
    """Zero each decoder layer's attention output and MLP down projections: the layers start as the
    identity on their residual stream (the copied attention / MLP input weights still give the
    first gradients a useful direction)."""
    with torch.no_grad():
        for layer in layers:
            for name, p in layer.named_parameters():
                if name.split(".")[-2] in ("o_proj", "down_proj"):
                    p.zero_()


def init_fusion_as_identity(fusion: nn.Linear, scale: float = 1.0) -> None:
    """A (d, 2d) fusion of cat(embedding, features) that starts as `scale * features`: embedding half
    zero, feature half a scaled identity, no bias."""
    d = fusion.weight.shape[0]
    with torch.no_grad():
        fusion.weight.zero_()
        fusion.weight[:, d:] = scale * torch.eye(d, dtype=fusion.weight.dtype)
        if fusion.bias is not None:
            fusion.bias.zero_()


def target_state_rms(target: LlamaForCausalLM, tokens: int = 64) -> float:
    """The typical RMS of the target's pre-norm last hidden state (the residual stream its last
    layer reads), measured on a fixed probe sequence: its median over positions. A partial target
    (load_llama(..., layers=)) cannot run the probe: it carries the value measured on the whole
    model (its `state_rms`, set by whoever ran the whole model, e.g. its tensor-parallel shards)."""
    from headstart.nn.attention import PackedCausalAttention, packed_metadata

    if target.partial:
        if target.state_rms is None:
            raise ValueError("this partial target cannot measure its hidden-state RMS (no forward): set its "
                             "state_rms from the whole model (target_state_rms on the whole or sharded target)")
        return target.state_rms
    device = target.model.embed_tokens.weight.device
    n = min(tokens, target.config.max_position_embeddings)
    ids = (torch.arange(n, device=device) * 7919 + 1) % target.config.vocab_size  # a fixed spread of ids
    with torch.no_grad():
        h, _ = target(ids, packed_metadata([n], device=device), [None] * target.num_layers, PackedCausalAttention())
    return float(h.float().pow(2).mean(-1).sqrt().median())


def copy_layer(dst: nn.Module, src: nn.Module) -> None:
    """Copy matching parameters (same name, same shape) from a target layer into a head layer."""
    src_params = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            if name in src_params and src_params[name].shape == p.shape:
                p.copy_(src_params[name])
