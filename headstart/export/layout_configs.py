"""The config.json pieces several serving layouts share: the draft layer's HF config, the `headstart`
record every export carries, our head config read back from an export, and the refusals more than one
layout gives. Tensor renaming and the key-set checks are in layout.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from headstart.errors import AssetError
from headstart.export.layout import target_hf_config
from headstart.heads import DraftHead, HeadConfig
from headstart.heads.config import EAGLE_FLAGS
from headstart.models.llama import LlamaForCausalLM

_DIMS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def draft_layer_config(head: DraftHead, target: LlamaForCausalLM, model_type: str | None = None) -> dict[str, Any]:
    """The target's HF config with the head's dimensions and depth (a decoder-layer config)."""
    cfg = target_hf_config(target)
    for key in _DIMS:
        cfg[key] = getattr(head.config, key)
    cfg["num_hidden_layers"] = head.config.num_layers
    if isinstance(cfg.get("layer_types"), list):  # per-layer attention kinds: the head's own layers
        cfg["layer_types"] = cfg["layer_types"][-head.config.num_layers:]
    if model_type:
        cfg["model_type"] = model_type
    for key in ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version"):
        cfg.pop(key, None)
    return cfg


def feature_convention(head: DraftHead) -> str:
    """Which target state the head reads, as every export records it."""
    cfg = head.config
    if cfg.head_type in ("eagle3", "dflash"):
        return f"hidden states entering target layers {cfg.aux_layer_ids}, concatenated"
    if cfg.head_type == "draft_lm":
        return "none (tokens only)"
    if cfg.head_type == "medusa" or cfg.postnorm_features:
        return "last_hidden_post_norm: the target's output after its final norm"
    return "last_hidden_pre_norm: the last decoder layer's output before the final norm"


def norm_flags(cfg: HeadConfig) -> dict[str, Any]:
    """The norm placement flags a layout's fixed names must match (the feature convention aside)."""
    return {k: getattr(cfg, k) for k in EAGLE_FLAGS["mtp"] if k != "postnorm_features"}


def refuse_prenorm(head: DraftHead, engine: str) -> str | None:
    """vLLM and SGLang hand every drafter but EAGLE-3 the target model's output, which for these
    families is after the final norm (vLLM gpu_model_runner: target_hidden_states =
    hidden_states[:num_scheduled_tokens]); a head trained on the pre-norm state would read
    another input than it learned."""
    if head.config.head_type in ("mtp", "deepseek_mtp") and not head.config.postnorm_features:
        return (f"{engine} feeds the drafter the target's output after its final norm, and this "
                f"{head.config.head_type} head was trained on the state before it; train it with "
                "head.postnorm_features: true (head init --postnorm-features) to serve it there")
    return None


def export_record(head: DraftHead, fmt: str) -> dict[str, Any]:
    """The `headstart` record of an export's config.json: what wrote it, and the head config it was."""
    from headstart import __version__

    return {"export_format": fmt, "head_type": head.config.head_type, "version": __version__,
            "feature_convention": feature_convention(head), "head_config": dataclasses.asdict(head.config)}


def imported_head_config(config: dict[str, Any], head_type: str, target: LlamaForCausalLM, **fields: Any) -> HeadConfig:
    """Our head config: the recorded one when we wrote the export, else built from the layout."""
    meta = config.get("headstart")
    if isinstance(meta, dict) and isinstance(meta.get("head_config"), dict):
        raw = dict(meta["head_config"])
        raw.pop("target", None)
        try:
            return HeadConfig.from_record(raw)
        except (TypeError, ValueError) as e:
            raise AssetError(f"config.json: the recorded headstart head_config is invalid ({str(e)[:160]})") from None
    try:
        return HeadConfig(head_type=head_type, **fields)
    except ValueError as e:  # e.g. aux layer ids a serving engine would read in another order
        raise AssetError(f"config.json: {str(e)[:200]}") from None


def layer_dims(cfg: dict[str, Any]) -> dict[str, Any]:
    """The layer dimensions a layout's config gives (the ones it leaves out take HeadConfig's defaults)."""
    return {k: cfg[k] for k in _DIMS if cfg.get(k) is not None}

