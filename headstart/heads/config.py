"""A draft head's typed config (`HeadConfig`), the head families and their flags, and the checks that
a config fits its target (`check_compatible`) — read by every head family, the trainer, plan and export.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headstart.errors import AssetError
from headstart.models.llama import LlamaForCausalLM
from headstart.nn.decoder import DecoderLayerConfig

HEAD_TYPES = ("mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm", "dflash")
# Families that draft a chain (and trees) from their own fed-back state: the TTT-unrolled families.
CHAIN_HEADS = ("mtp", "eagle1", "deepseek_mtp", "eagle3")
# Families that fuse the hidden states entering several target layers (head.aux_layer_ids).
AUX_FAMILIES = ("eagle3", "dflash")
MAX_BLOCK_SIZE = 32  # dflash: positions per drafted block (the drafts per step + 1)
HIDDEN_STATE_CONVENTION = {
    "last_hidden": "output of the last decoder layer before the final norm",
    "aux_layers": "hidden state entering decoder layer j (HF hidden_states[j]; j = 0 is the embedding output)",
}

# Heads built on DeepSeek (MLA) targets.
DEEPSEEK_TARGET_HEADS = ("deepseek_mtp", "medusa")
# mtp and eagle1 are one code path; these flags are their only difference (README: Head families).
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
