"""What every draft head shares: the typed config, the frozen target parts and the shift by one
(the native checkpoint is in checkpoint.py; docs/architecture.md).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headstart.errors import AssetError
from headstart.models.llama import LlamaForCausalLM
from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.decoder import DecoderLayerConfig
from headstart.nn.rope import RotaryEmbedding

HEAD_TYPES = ("mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm", "dflash")
# Families that fuse the hidden states entering several target layers (head.aux_layer_ids).
AUX_FAMILIES = ("eagle3", "dflash")
MAX_BLOCK_SIZE = 32  # dflash: positions per drafted block (the drafts per step + 1)
HIDDEN_STATE_CONVENTION = {
    "last_hidden": "output of the last decoder layer before the final norm",
    "aux_layers": "hidden state entering decoder layer j (HF hidden_states[j]; j = 0 is the embedding output)",
}

# Heads built on DeepSeek (MLA) targets.
DEEPSEEK_TARGET_HEADS = ("deepseek_mtp", "medusa")
# mtp and eagle1 are one code path; these flags are their only difference (README: head families).
# Families whose input is the target's last state, which they may read after its final norm.
POSTNORM_FAMILIES = ("mtp", "eagle1", "deepseek_mtp")
EAGLE_FLAGS = {
    "mtp": {"embed_norm": True, "hidden_norm": True, "layer_input_norm": True, "final_norm": True,
            "postnorm_features": False, "fc_bias": False},
    "eagle1": {"embed_norm": False, "hidden_norm": False, "layer_input_norm": False, "final_norm": False,
               "postnorm_features": True, "fc_bias": True},
}
# EAGLE-3.1 norm flags of eagle3 heads, with speculators' (0.9.0, models/eagle3/core.py) semantics:
#   norm_before_fc        one RMSNorm over the concatenated aux states (A d) before fc
#   fc_norm               one RMSNorm per aux state (d each) before fc; exclusive with norm_before_fc
#   norm_before_residual  the first layer's residual is hidden_norm(f), not f
#   norm_output           the state fed back to the next draft step is norm(y), the one the logits read
# A new head gets speculators' trainer defaults (train/config/schema.py: norm_before_residual true,
# norm_before_fc and norm_output true for eagle3, fc_norm false); a head saved before the flags
# existed has them all off (HeadConfig.from_record).
EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
EAGLE31_DEFAULTS = {"norm_before_fc": True, "fc_norm": False, "norm_before_residual": True, "norm_output": True}


@dataclass(kw_only=True)
class HeadConfig:
    """A head's shape. Fields left None are filled from the target by `resolve`."""

    head_type: str
    num_layers: int = 1  # decoder layers (1 for mtp/eagle1/eagle3/deepseek_mtp; draft_lm: its depth)
    intermediate_size: int | None = None  # None: the target's
    aux_layer_ids: list[int] | None = None  # eagle3: layers whose entering hidden states are fused
    draft_vocab_size: int | None = None  # eagle3 / medusa: own reduced lm_head; other chains: the target's rows
    medusa_num_heads: int = 4
    medusa_num_layers: int = 1  # residual blocks per Medusa head
    share_target_embeddings: bool = True  # draft_lm: use the target's embedding and lm_head (same width)
    hidden_size: int | None = None  # draft_lm may be narrower than the target; others use the target's
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    # EAGLE-family norm flags (see EAGLE_FLAGS); None = the family default. postnorm_features also
    # applies to deepseek_mtp (default off): the head reads the target's state after its final norm.
    embed_norm: bool | None = None
    hidden_norm: bool | None = None
    layer_input_norm: bool | None = None
    final_norm: bool | None = None
    postnorm_features: bool | None = None
    fc_bias: bool | None = None
    dense_block: bool = False  # deepseek_mtp on a DeepSeek target: a dense MLP instead of the target's MoE
    block_size: int | None = None  # dflash: positions per block (anchor + block_size - 1 drafts); None: 8
    mask_token_id: int | None = None  # dflash: the token filling the block's draft slots; None: the tokenizer's
    # eagle3: EAGLE-3.1 norm flags (EAGLE31_FLAGS); None = EAGLE31_DEFAULTS for a new head.
    norm_before_fc: bool | None = None
    fc_norm: bool | None = None
    norm_before_residual: bool | None = None
    norm_output: bool | None = None
    # Filled by resolve(): the target this head belongs to.
    target: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head type {self.head_type!r}; choose one of {', '.join(HEAD_TYPES)}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.medusa_num_heads < 1 or self.medusa_num_layers < 1:
            raise ValueError(f"medusa_num_heads and medusa_num_layers must be >= 1, got {self.medusa_num_heads} "
                             f"and {self.medusa_num_layers}")
        if self.head_type != "dflash" and (self.block_size is not None or self.mask_token_id is not None):
            raise ValueError(f"block_size and mask_token_id apply to dflash heads, not {self.head_type}")
        for name in ("block_size", "mask_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {str(value)[:20]!r}")
        if self.head_type in AUX_FAMILIES and self.aux_layer_ids is not None and not self.aux_layer_ids:
            raise ValueError(f"a {self.head_type} head fuses at least one target layer: aux_layer_ids is empty")
        why = aux_ids_problem(self.aux_layer_ids)
        if why:
            raise ValueError(why)
        if self.block_size is not None and not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in 2..{MAX_BLOCK_SIZE}, got {self.block_size}")
        if self.postnorm_features and self.head_type not in POSTNORM_FAMILIES:
            raise ValueError(f"postnorm_features applies to {', '.join(POSTNORM_FAMILIES)} heads, not {self.head_type}")
        for name, value in EAGLE_FLAGS.get(self.head_type, {}).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        # Named as config.json spells them (a saved head's, an export's record); the recipe names its own keys.
        for name in EAGLE31_FLAGS:
            value = getattr(self, name)
            if value is not None and self.head_type != "eagle3":
                raise ValueError(f"{name} applies to eagle3 heads, not {self.head_type} (got {json_shown(value)})")
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {json_shown(value)}")
            if self.head_type == "eagle3" and value is None:  # fc_norm asked for: the other input norm off
                setattr(self, name, EAGLE31_DEFAULTS[name] and not (name == "norm_before_fc" and self.fc_norm))
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are exclusive (one norm over the concatenated aux states, or "
                             "one per state; speculators refuses both)")

    @classmethod
    def from_record(cls, raw: dict[str, Any]) -> HeadConfig:
        """The config of a saved head (a checkpoint's config.json, an export's headstart record): a record
        written before the EAGLE-3.1 flags existed was saved with them off, not with a new head's defaults."""
        raw = dict(raw)
        for name in EAGLE31_FLAGS:
            if raw.get("head_type") == "eagle3" and name in raw and raw[name] is None:  # not a new head's default
                raise ValueError(f"{name} must be true or false, got null")
            raw.setdefault(name, saved_without(name, raw.get("head_type")))
        return cls(**raw)

    def resolve(self, target: LlamaForCausalLM) -> HeadConfig:
        """A copy with every dimension filled from the target, checked against it."""
        t = target.config
        from headstart.models.deepseek import SUPPORTED_MODEL_TYPES as DEEPSEEK

        if t.model_type in DEEPSEEK and self.head_type not in DEEPSEEK_TARGET_HEADS:
            raise AssetError(f"a {self.head_type} head on a DeepSeek target ({t.model_type}) is not built: its block "
                             "would be a Llama layer; train a deepseek_mtp head (the target's own MLA / MoE block) "
                             "or medusa")
        cfg = dataclasses.replace(self)
        if cfg.head_type != "draft_lm" or cfg.share_target_embeddings or cfg.hidden_size is None:
            cfg.hidden_size = cfg.hidden_size or t.hidden_size
        cfg.intermediate_size = cfg.intermediate_size or t.intermediate_size
        cfg.num_attention_heads = cfg.num_attention_heads or t.num_attention_heads
        # A DeepSeek (MLA) target has no GQA head shape: a Llama-style block would use full heads.
        cfg.num_key_value_heads = cfg.num_key_value_heads or getattr(t, "num_key_value_heads", t.num_attention_heads)
        cfg.head_dim = cfg.head_dim or block_head_dim(t)
        if cfg.head_type in AUX_FAMILIES and cfg.aux_layer_ids is None:
            cfg.aux_layer_ids = default_aux_layers(t.num_hidden_layers)
        if cfg.head_type == "dflash":
            cfg.block_size = cfg.block_size or 8
            if cfg.mask_token_id is None:
                cfg.mask_token_id = default_mask_token(target)
            if not 0 <= cfg.mask_token_id < t.vocab_size:
                raise AssetError(f"mask_token_id={cfg.mask_token_id} is outside the target's vocabulary "
                                 f"(0..{t.vocab_size - 1})")
        cfg.target = {
            "model_type": t.model_type, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
            "num_hidden_layers": t.num_hidden_layers, "fingerprint": target.fingerprint(),
        }
        check_compatible(cfg, target, where="head config")
        return cfg

    def layer_config(self, target: LlamaForCausalLM, **overrides: Any) -> DecoderLayerConfig:
        t = target.config
        kw = dict(
            hidden=self.hidden_size, intermediate=self.intermediate_size, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim, norm_eps=t.rms_norm_eps,
            act=t.hidden_act, qkv_bias=t.attention_bias, qk_norm=t.qk_norm, mlp_bias=t.mlp_bias,
        )
        kw.update(overrides)
        return DecoderLayerConfig(**kw)


def json_shown(value: Any) -> str:
    """A config value as its file spells it (true, null), a string quoted and cut short."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(str(value)[:20])


def saved_without(name: str, head_type: Any) -> Any:
    """The value of EAGLE-3.1 flag `name` in a record saved before the flags existed (all off)."""
    return False if head_type == "eagle3" else None


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's (and DFlash's) default fused layers: low, middle and high (2, L // 2, L - 3), distinct and
    ascending also on a target of under 6 layers."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


def aux_ids_problem(ids: list[int] | None) -> str | None:
    """Why these aux layer ids cannot be a head's, or None. They must be distinct and ascending: vLLM and
    SGLang capture the states in layer order whatever order a config lists them in, so a head whose fc
    reads them in another order would be served a permutation of its input."""
    if not ids:
        return None
    if len(set(ids)) != len(ids):
        return f"aux_layer_ids must be distinct, got {ids[:8]}"
    if list(ids) != sorted(ids):
        return (f"aux_layer_ids must be ascending (the order vLLM and SGLang concatenate the states in), got "
                f"{ids[:8]}; write {sorted(ids)[:8]}")
    return None


def default_mask_token(target: LlamaForCausalLM) -> int:
    """The token a dflash block's draft slots hold when head.mask_token_id is not set: the target
    tokenizer's mask token, else its unknown, pad or EOS token (speculators' order, less the option of
    adding a token); without a tokenizer the first EOS id, else 0."""
    source = getattr(target, "source_dir", None)
    if source is not None and (Path(source) / "tokenizer_config.json").is_file():
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(source))
        except Exception:  # a tokenizer transformers cannot read: fall back to the config's ids
            tok = None
        for name in ("mask_token_id", "unk_token_id", "pad_token_id", "eos_token_id"):
            value = getattr(tok, name, None) if tok is not None else None
            if isinstance(value, int):
                return value
    eos = target.config.eos_token_ids
    return int(eos[0]) if eos else 0


def block_head_dim(t: Any) -> int:
    """The head dimension of a Llama-style block on this target (an MLA target has none of its own)."""
    return getattr(t, "head_dim", t.hidden_size // t.num_attention_heads)


def check_compatible(cfg: HeadConfig, target: LlamaForCausalLM, where: str) -> None:
    """A head made for another target is refused, naming both values."""
    t = target.config
    rec = cfg.target
    for key, have in (("hidden_size", t.hidden_size), ("vocab_size", t.vocab_size),
                      ("num_hidden_layers", t.num_hidden_layers)):
        if key in rec and rec[key] != have:
            raise AssetError(f"{where}: the head was made for a target with {key}={rec[key]}, this target has {have}")
    if cfg.head_type != "draft_lm" and cfg.hidden_size not in (None, t.hidden_size):
        raise AssetError(f"{where}: head hidden_size={cfg.hidden_size} but the target's is {t.hidden_size}")
    for j in cfg.aux_layer_ids or []:
        if not 0 <= j <= t.num_hidden_layers:
            raise AssetError(
                f"{where}: aux layer {j} is out of range for a target with {t.num_hidden_layers} layers "
                f"(valid: 0..{t.num_hidden_layers})"
            )
    if cfg.draft_vocab_size is not None and not 0 < cfg.draft_vocab_size <= t.vocab_size:
        raise AssetError(f"{where}: draft_vocab_size={cfg.draft_vocab_size} exceeds the target vocab {t.vocab_size}")
    # Sane bounds relative to the target, checked before anything is allocated: a config file saying
    # num_layers: 10**9 must be an error, not an out-of-memory kill.
    bounds = (("num_layers", cfg.num_layers, t.num_hidden_layers),
              ("intermediate_size", cfg.intermediate_size, 8 * t.intermediate_size),
              ("hidden_size", cfg.hidden_size, 2 * t.hidden_size),
              ("num_attention_heads", cfg.num_attention_heads, 4 * t.num_attention_heads),
              ("num_key_value_heads", cfg.num_key_value_heads, 4 * t.num_attention_heads),
              ("head_dim", cfg.head_dim, 4 * block_head_dim(t)),
              ("medusa_num_heads", cfg.medusa_num_heads, 32), ("medusa_num_layers", cfg.medusa_num_layers, 16))
    for key, value, most in bounds:
        if value is not None and not (isinstance(value, int) and 1 <= value <= most):
            raise AssetError(f"{where}: {key}={str(value)[:20]} is outside 1..{most} for this target "
                             f"({t.num_hidden_layers} layers, hidden {t.hidden_size})")


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
