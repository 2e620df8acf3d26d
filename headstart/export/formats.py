"""The serving layouts (docs/formats.md), checked against the loaders' sources:

| format         | heads                  | loader it targets                                                      |
|----------------|------------------------|------------------------------------------------------------------------|
| `sglang`       | eagle3, eagle1, dflash | SGLang `LlamaForCausalLMEagle3` / `LlamaForCausalLMEagle` (EAGLE code) |
|                |                        | / `DFlashDraftModel` (sglang_dflash.py)                                 |
| `vllm`         | eagle3, mtp (Qwen3),   | vLLM speculators format (`speculators` 0.9.0 `eagle3` / `mtp` /        |
|                | dflash, eagle1         | `dflash`); eagle1: vLLM's own EAGLE directory (`EagleLlamaForCausalLM`) |
| `deepseek-mtp` | deepseek_mtp, mtp      | DeepSeek-V3 MTP module at `model.layers.{L}` (vLLM/SGLang MTP loaders), |
|                |                        | DeepSeek targets only: those loaders build a DeepSeek block            |
| `medusa`       | medusa                 | vLLM `Medusa` (`blocks.*`, `lm_heads.*`, `token_map`)                 |
| `hf`           | draft_lm               | a plain HF `LlamaForCausalLM` directory (any engine's draft model)    |

Aux-layer ids: ours name the hidden state ENTERING a layer (HF hidden_states[j]); vLLM's
`eagle_aux_hidden_state_layer_ids` use the same convention, SGLang's name a layer's OUTPUT (it
captures at id + 1), so SGLang exports write j - 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from headstart.errors import AssetError
from headstart.export import sglang_dflash
from headstart.export.layout import (
    Layout,
    config_bool,
    config_dict,
    config_ids,
    config_int,
    invert,
    join_fused,
    native_state,
    rename,
    require,
    split_fused,
    target_hf_config,
)
from headstart.heads import DraftHead, HeadConfig
from headstart.heads.base import EAGLE31_FLAGS, EAGLE_FLAGS, default_aux_layers
from headstart.models.deepseek import SUPPORTED_MODEL_TYPES as DEEPSEEK_MODEL_TYPES
from headstart.models.llama import LlamaForCausalLM

SPECULATORS_VERSION = "0.9.0"
# EAGLE-3.1 flags SGLang's LlamaForCausalLMEagle3 lacks: its model (sglang/srt/models/llama_eagle3.py) builds
# fc_norm.{i} when `fc_norm` is set and feeds back the post-norm state when `norm_output` is, but has no
# norm over the concatenated aux states (no input_norm) and always keeps the un-normed fc output as the
# first layer's residual.
SGLANG_MISSING_FLAGS = ("norm_before_fc", "norm_before_residual")
_SGLANG_MISSING_NORM = {"norm_before_fc": "an RMSNorm over the concatenated aux states before fc",
                        "norm_before_residual": "hidden_norm on the first layer's residual"}
_DIMS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def _layer_config(head: DraftHead, target: LlamaForCausalLM, model_type: str | None = None) -> dict[str, Any]:
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


def _norm_flags(cfg: HeadConfig) -> dict[str, Any]:
    """The norm placement flags a layout's fixed names must match (the feature convention aside)."""
    return {k: getattr(cfg, k) for k in EAGLE_FLAGS["mtp"] if k != "postnorm_features"}


def _needs_postnorm(head: DraftHead, engine: str) -> str | None:
    """vLLM and SGLang hand every drafter but EAGLE-3 the target model's output, which for these
    families is after the final norm (vLLM gpu_model_runner: target_hidden_states =
    hidden_states[:num_scheduled_tokens]); a head trained on the pre-norm state would read
    another input than it learned."""
    if head.config.head_type in ("mtp", "deepseek_mtp") and not head.config.postnorm_features:
        return (f"{engine} feeds the drafter the target's output after its final norm, and this "
                f"{head.config.head_type} head was trained on the state before it; train it with "
                "head.postnorm_features: true (head init --postnorm-features) to serve it there")
    return None


def _meta(head: DraftHead, fmt: str) -> dict[str, Any]:
    from headstart import __version__

    return {"export_format": fmt, "head_type": head.config.head_type, "version": __version__,
            "feature_convention": feature_convention(head), "head_config": dataclasses.asdict(head.config)}


def _head_config(config: dict[str, Any], head_type: str, target: LlamaForCausalLM, **fields: Any) -> HeadConfig:
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


def _dims(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: cfg[k] for k in _DIMS if cfg.get(k) is not None}


def _no_qk_norm(head: DraftHead, name: str) -> str | None:
    if head.config.head_type != "medusa" and any(".q_norm." in k for k in head.state_dict()):
        return f"{name}'s Llama decoder layer has no q/k norms, which this target family's layers have"
    return None


# --------------------------------------------------------------------------------------- SGLang


class SGLang(Layout):
    name = "sglang"
    families = ("eagle3", "eagle1", "dflash")  # dflash: sglang_dflash.py

    def refuse(self, head: DraftHead) -> str | None:
        if head.config.head_type == "dflash":
            return sglang_dflash.refuse(head)
        why = super().refuse(head) or _no_qk_norm(head, "SGLang")
        if why:
            return why
        cfg = head.config
        if cfg.head_type == "eagle3":
            if cfg.num_layers != 1:
                return f"SGLang's LlamaForCausalLMEagle3 has one layer (`midlayer`); this head has {cfg.num_layers}"
            if 0 in cfg.aux_layer_ids:
                return "SGLang names aux layers by the layer whose output they are: aux 0 (the embedding) has none"
            for flag in SGLANG_MISSING_FLAGS:
                if getattr(cfg, flag):
                    return (f"SGLang's LlamaForCausalLMEagle3 does not implement head.{flag} (it reads fc_norm and "
                            f"norm_output only: sglang/srt/models/llama_eagle3.py); train the head with "
                            f"head.{flag}: false (head init --no-{flag.replace('_', '-')}) to serve it on SGLang, or "
                            "export it with --format vllm")
        else:
            flags = {k: getattr(cfg, k) for k in EAGLE_FLAGS["eagle1"] if k != "fc_bias"}  # none: a zero bias
            if flags != {k: v for k, v in EAGLE_FLAGS["eagle1"].items() if k != "fc_bias"}:
                return f"SGLang's LlamaForCausalLMEagle is the original EAGLE head; these norm flags differ: {flags}"
        return None

    @staticmethod
    def _rules(head_type: str) -> list[tuple[str, str]]:
        if head_type == "eagle3":
            return [("layers.0", "midlayer"), ("embed_norm", "midlayer.input_layernorm"),
                    ("hidden_norm", "midlayer.hidden_norm")]
        return []

    def write(self, head, target):  # noqa: ANN001, ANN201
        cfg = head.config
        if cfg.head_type == "dflash":
            return sglang_dflash.write(head, target, _layer_config(head, target, "qwen3"), _meta(head, self.name))
        state = split_fused(rename(native_state(head), self._rules(cfg.head_type)), cfg)
        config = _layer_config(head, target, "llama")
        config["tie_word_embeddings"] = False
        if cfg.head_type == "eagle3":
            if "lm_head.weight" not in state:  # no draft vocabulary: the target's rows, identity maps
                state["lm_head.weight"] = target.lm_head.weight.detach().cpu().clone()
            config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=int(state["d2t"].numel()),
                          target_hidden_size=target.config.hidden_size,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": [j - 1 for j in cfg.aux_layer_ids],
                                        "use_aux_hidden_state": True})
            config.update(fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)  # read as config attributes
        else:
            config.update(architectures=["LlamaForCausalLMEagle"])
            if not cfg.fc_bias:  # SGLang's fc always has a bias: a zero one is this head exactly
                state["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=state["fc.weight"].dtype)
        config["headstart"] = _meta(head, self.name)
        return config, state

    def recognise(self, config):  # noqa: ANN001, ANN201
        arch = config.get("architectures") or []
        if arch in (["LlamaForCausalLMEagle3"], ["LlamaForCausalLMEagle"], [sglang_dflash.ARCHITECTURE]):
            return None
        return f"architectures {arch!r} (expected LlamaForCausalLMEagle3, LlamaForCausalLMEagle or DFlashDraftModel)"

    def tensor_names(self, config, tensors):  # noqa: ANN001, ANN201
        dflash = config["architectures"] == [sglang_dflash.ARCHITECTURE]
        return sglang_dflash.plain_names(tensors) if dflash else tensors

    def read(self, config, tensors, target):  # noqa: ANN001, ANN201
        if config["architectures"] == [sglang_dflash.ARCHITECTURE]:
            fields, state = sglang_dflash.read(config, tensors, target)
            return _head_config(config, "dflash", target, **fields, **_dims(config)), state
        eagle3 = config["architectures"] == ["LlamaForCausalLMEagle3"]
        state = rename(join_fused(tensors), invert(self._rules("eagle3" if eagle3 else "eagle1")))
        if eagle3:
            key = "eagle_config.eagle_aux_hidden_state_layer_ids"
            ids = config_ids(config_dict(config, "eagle_config").get("eagle_aux_hidden_state_layer_ids"), key)
            n = target.config.num_hidden_layers
            if ids and (any(not 0 <= j < n for j in ids) or ids != sorted(set(ids))):  # in SGLang's own numbers
                raise AssetError(f"config.json: {key} {ids[:8]} must be distinct, ascending layer ids in 0..{n - 1}: "
                                 "SGLang names the layer whose OUTPUT it captures (e.g. [1, 14, 26] for a 30-layer "
                                 "target)")
            aux = [j + 1 for j in ids] if ids else default_aux_layers(n)
            vocab = config_int(config, "draft_vocab_size")
            flags = {"fc_norm": config_bool(config, "fc_norm") or config_bool(config, "use_aux_norm"),
                     "norm_output": config_bool(config, "norm_output")}
            for flag in SGLANG_MISSING_FLAGS:  # SGLang ignores them: it would serve another head than was trained
                if config_bool(config, flag):
                    raise AssetError(f"config.json: {flag} is true, but SGLang's LlamaForCausalLMEagle3 has no such "
                                     f"norm ({_SGLANG_MISSING_NORM[flag]}; sglang/srt/models/llama_eagle3.py), so it "
                                     "would serve this head without it; a head trained with it serves on vLLM: "
                                     "export it from its training checkpoint with --format vllm")
                flags[flag] = False
            cfg = _head_config(config, "eagle3", target, aux_layer_ids=aux, draft_vocab_size=vocab, **flags,
                               **_dims(config))
            cfg.draft_vocab_size = vocab
            state.pop("embed_tokens.weight", None)  # EAGLE-3 checkpoints may carry the target's embedding
        else:
            cfg = _head_config(config, "eagle1", target, num_layers=config_int(config, "num_hidden_layers", 1),
                               **_dims(config))
            state.pop("embed_tokens.weight", None)
            state.pop("lm_head.weight", None)
            if cfg.fc_bias is False and "fc.bias" in state:  # our head without a bias, written with a zero one
                if state["fc.bias"].any():
                    raise AssetError("fc.bias is not zero, but the recorded head config says the head has no fc "
                                     "bias (head.fc_bias: false)")
                del state["fc.bias"]
        return cfg, state


# ----------------------------------------------------------------------------- vLLM speculators


# vLLM's EAGLE-1 drafter (vllm/model_executor/models/llama_eagle.py, `method: eagle`): fc (2H -> H) WITHOUT a
# bias over cat(embedding, the target's post-norm state), the first layer without its input norm, no norm
# before the target's lm_head; config.json is the layer's Llama config. speculators has no `eagle` type.
VLLM_EAGLE1_ARCH = "EagleLlamaForCausalLM"


class VLLM(Layout):
    name = "vllm"
    families = ("eagle3", "mtp", "dflash", "eagle1")
    optional = ("t2d",)  # vLLM ignores t2d; a checkpoint without it gets one rebuilt from d2t

    def refuse(self, head: DraftHead) -> str | None:
        cfg = head.config
        if cfg.head_type == "dflash":  # speculators' dflash keeps a reduced lm_head: the rows are written
            return None
        why = super().refuse(head)
        if why:
            return why
        if cfg.head_type == "eagle1":
            return self._refuse_eagle1(head)
        if cfg.head_type == "mtp":
            family = cfg.target.get("model_type")
            if family != "qwen3":
                return (f"the speculators `mtp` type takes Qwen3-family targets only, this target is {family!r}; "
                        "for another family only --format native holds an mtp head today")
            why = _needs_postnorm(head, "vLLM")
            if why:
                return why
            flags = _norm_flags(cfg)
            if flags != _norm_flags(HeadConfig(head_type="mtp")) or cfg.num_layers != 1:
                return f"the speculators `mtp` layer is one RMSNorm-restored layer; this head has {cfg.num_layers} " \
                       f"layers and flags {flags}"
        return None

    @staticmethod
    def _refuse_eagle1(head: DraftHead) -> str | None:
        cfg = head.config
        if cfg.target.get("model_type") != "llama":
            return f"vLLM's EAGLE-1 drafter ({VLLM_EAGLE1_ARCH}) is built on Llama layers; this target is " \
                   f"{cfg.target.get('model_type')!r}"
        if cfg.fc_bias:
            return (f"vLLM's {VLLM_EAGLE1_ARCH} has no fc bias (vllm/model_executor/models/llama_eagle.py); train "
                    "the eagle1 head with head.fc_bias: false to serve it on vLLM, or export it with --format "
                    "sglang (SGLang's LlamaForCausalLMEagle keeps the bias)")
        flags = {k: getattr(cfg, k) for k in EAGLE_FLAGS["eagle1"]}
        if flags != {**EAGLE_FLAGS["eagle1"], "fc_bias": False}:
            return f"vLLM's {VLLM_EAGLE1_ARCH} is the original EAGLE head; these norm flags differ: {flags}"
        return None

    @staticmethod
    def _rules(head_type: str) -> list[tuple[str, str]]:
        if head_type == "eagle3":
            return [("embed_norm", "layers.0.input_layernorm"), ("hidden_norm", "layers.0.hidden_norm")]
        return [("embed_norm", "mtp_layers.0.token_layernorm"), ("hidden_norm", "mtp_layers.0.hidden_layernorm"),
                ("fc", "mtp_layers.0.input_proj"), ("norm", "mtp_layers.0.final_layernorm"),
                ("layers.0", "mtp_layers.0")]

    def write(self, head, target):  # noqa: ANN001, ANN201
        cfg = head.config
        if cfg.head_type == "dflash":
            return self._write_dflash(head, target)
        if cfg.head_type == "eagle1":  # vLLM shares the verifier's embedding and lm_head (none written)
            config = {**_layer_config(head, target, "llama"), "architectures": [VLLM_EAGLE1_ARCH],
                      "tie_word_embeddings": False, "headstart": _meta(head, self.name)}
            return config, split_fused(native_state(head), cfg)
        family = "qwen3" if cfg.target.get("model_type") == "qwen3" else "llama"
        layer = _layer_config(head, target, family)
        verifier = {"name_or_path": str(target.source_dir) if target.source_dir else None,
                    "architectures": target_hf_config(target).get("architectures") or ["LlamaForCausalLM"]}
        state = split_fused(rename(native_state(head), self._rules(cfg.head_type)), cfg)
        common = {"transformer_layer_config": layer, "speculators_version": SPECULATORS_VERSION}
        if cfg.head_type == "eagle3":
            if "lm_head.weight" not in state:
                state["lm_head.weight"] = target.lm_head.weight.detach().cpu().clone()
            if not cfg.draft_vocab_size:  # vLLM builds no draft_id_to_target_id for a full vocabulary and
                del state["d2t"], state["t2d"]  # refuses a checkpoint that carries one
            config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], **common,
                      "draft_vocab_size": cfg.draft_vocab_size or target.config.vocab_size,
                      **{flag: getattr(cfg, flag) for flag in EAGLE31_FLAGS},
                      "target_hidden_size": target.config.hidden_size,
                      "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}
        else:
            config = {"speculators_model_type": "mtp", "architectures": ["MTPDraftModel"], **common,
                      "num_nextn_predict_layers": 1}
        config["speculators_config"] = {
            "algorithm": cfg.head_type, "default_proposal_method": "greedy", "verifier": verifier,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}
        config["headstart"] = _meta(head, self.name)
        return config, state

    @staticmethod
    def _verifier(target: LlamaForCausalLM) -> dict[str, Any]:
        return {"name_or_path": str(target.source_dir) if target.source_dir else None,
                "architectures": target_hf_config(target).get("architectures") or ["LlamaForCausalLM"]}

    def _write_dflash(self, head: DraftHead, target: LlamaForCausalLM) -> tuple[dict[str, Any], dict[str, Any]]:
        """speculators' `dflash` (DFlashDraftModel): fc, hidden_norm, layers.* (Qwen3 layers: q/k norms),
        norm; with a draft vocabulary lm_head.weight (the target's rows of its tokens) and d2t / t2d;
        the embedding and the full lm_head come from the verifier. aux_hidden_state_layer_ids name
        the hidden states entering those layers (speculators' and vLLM's convention, as ours)."""
        cfg = head.config
        state = split_fused(native_state(head), cfg)
        layer = _layer_config(head, target, "qwen3")
        layer.update(attention_bias=False, mlp_bias=False)
        vd = cfg.draft_vocab_size or target.config.vocab_size
        if cfg.draft_vocab_size:
            ids = torch.arange(vd) + state["d2t"]
            state["lm_head.weight"] = target.lm_head.weight.detach().cpu()[ids].clone()
        config = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
                  "transformer_layer_config": layer, "speculators_version": SPECULATORS_VERSION,
                  "draft_vocab_size": vd, "block_size": cfg.block_size, "target_hidden_size": target.config.hidden_size,
                  "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "mask_token_id": cfg.mask_token_id,
                  "sliding_window_non_causal": False, "sample_from_anchor": False,
                  "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                         "verifier": self._verifier(target),
                                         "proposal_methods": [{"proposal_type": "greedy",
                                                               "speculative_tokens": cfg.block_size - 1}]},
                  "headstart": _meta(head, self.name)}
        return config, state

    def _read_dflash(self, config: dict[str, Any], tensors: dict[str, Any],
                     target: LlamaForCausalLM) -> tuple[HeadConfig, dict[str, Any]]:
        layer = config_dict(config, "transformer_layer_config")
        if config.get("sample_from_anchor"):
            raise AssetError("config.json: sample_from_anchor is true (the anchor slot drafts too, as DSpark); our "
                             "dflash heads draft from the mask slots only")
        if layer.get("layer_types") and any(t != "full_attention" for t in layer["layer_types"]):
            raise AssetError(f"config.json: transformer_layer_config.layer_types {layer['layer_types']} has "
                             "sliding-window layers; our dflash heads attend over the whole context")
        if layer.get("attention_bias"):
            raise AssetError("config.json: transformer_layer_config.attention_bias is true; our dflash layers have "
                             "no biases")
        ids = config_ids(config.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids")
        vocab = target.config.vocab_size
        vd = config_int(config, "draft_vocab_size", vocab)
        mask = config.get("mask_token_id")
        if isinstance(mask, bool) or not isinstance(mask, int):
            raise AssetError(f"config.json: mask_token_id must be a token id, got {str(mask)[:20]!r}")
        cfg = _head_config(config, "dflash", target, aux_layer_ids=list(ids) if ids else None,
                           num_layers=config_int(layer, "num_hidden_layers", 1),
                           block_size=config_int(config, "block_size", 8, least=2), mask_token_id=mask,
                           draft_vocab_size=vd if vd != vocab else None, **_dims(layer))
        state = join_fused(tensors)
        for extra in ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"):
            state.pop(extra, None)
        if vd != vocab:
            if "d2t" not in state or "lm_head.weight" not in state:
                raise AssetError(f"draft_vocab_size {vd} is not the target's {vocab}, and d2t or lm_head.weight "
                                 "is missing")
            if "t2d" not in state:
                t2d = torch.zeros(vocab, dtype=torch.bool)
                t2d[(torch.arange(state["d2t"].numel()) + state["d2t"]).clamp(0, vocab - 1)] = True
                state["t2d"] = t2d
            rows = (torch.arange(state["d2t"].numel()) + state["d2t"]).clamp(0, vocab - 1)
            own = state.pop("lm_head.weight")
            want = target.lm_head.weight.detach().cpu()[rows].to(own.dtype)
            if own.shape != want.shape or not torch.allclose(own.float(), want.float(), atol=1e-3, rtol=1e-2):
                raise AssetError("lm_head.weight is not the target's rows of the draft tokens (a draft lm_head "
                                 "trained on its own); our dflash heads predict through the target's frozen "
                                 "lm_head rows, so this checkpoint cannot be imported")
        elif "lm_head.weight" in state:
            raise AssetError("lm_head.weight is present without a draft vocabulary; our dflash heads predict "
                             "through the target's frozen lm_head")
        return cfg, state

    def recognise(self, config):  # noqa: ANN001, ANN201
        kind = config.get("speculators_model_type")
        if kind in ("eagle3", "mtp", "dflash") or (kind is None and config.get("architectures") == [VLLM_EAGLE1_ARCH]):
            return None
        return f"speculators_model_type {kind!r} (expected 'eagle3', 'mtp' or 'dflash', or architectures " \
               f"[{VLLM_EAGLE1_ARCH!r}])"

    def read(self, config, tensors, target):  # noqa: ANN001, ANN201
        kind = config.get("speculators_model_type")
        if kind is None:  # vLLM's EAGLE-1 directory
            cfg = _head_config(config, "eagle1", target, num_layers=config_int(config, "num_hidden_layers", 1),
                               fc_bias=False, **_dims(config))
            state = join_fused(tensors)
            for extra in ("embed_tokens.weight", "lm_head.weight"):
                state.pop(extra, None)
            return cfg, state
        if kind == "dflash":
            return self._read_dflash(config, tensors, target)
        require(config, "transformer_layer_config", "config.json")
        layer = config_dict(config, "transformer_layer_config")
        state = rename(join_fused(tensors), invert(self._rules(kind)))
        for extra in ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"):
            state.pop(extra, None)
        if kind == "eagle3":
            ids = config_ids(config.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids")
            n = target.config.num_hidden_layers
            flags = {flag: config_bool(config, flag) for flag in EAGLE31_FLAGS}  # absent: off, as vLLM reads them,
            if "norm_before_residual" not in config:  # but this one: vLLM 0.32 serves an absent one as true
                flags["norm_before_residual"] = True  # (speculators/algos.py; speculators' own class reads false)
            cfg = _head_config(config, "eagle3", target, aux_layer_ids=list(ids) if ids else default_aux_layers(n),
                               num_layers=config_int(layer, "num_hidden_layers", 1), **flags, **_dims(layer))
            vd = config_int(config, "draft_vocab_size")
            cfg.draft_vocab_size = vd
            if vd == target.config.vocab_size and "d2t" not in state:  # a full vocabulary without maps (how we
                state["d2t"] = torch.zeros(vd, dtype=torch.int64)        # write it for vLLM): identity maps
                state["t2d"] = torch.ones(vd, dtype=torch.bool)
                own = state.get("lm_head.weight")
                theirs = target.lm_head.weight.detach().cpu()
                if own is None or (own.shape == theirs.shape and torch.equal(own, theirs.to(own.dtype))):
                    cfg.draft_vocab_size = None  # the target's lm_head predicts (else the checkpoint's own, kept)
                    state.pop("lm_head.weight", None)
            if "t2d" not in state and "d2t" in state:  # vLLM ignores t2d; rebuild it from d2t
                t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
                t2d[torch.arange(state["d2t"].numel()) + state["d2t"]] = True
                state["t2d"] = t2d
        else:
            cfg = _head_config(config, "mtp", target, postnorm_features=True, **_dims(layer))  # what vLLM feeds it
            state.pop("lm_head.weight", None)
        return cfg, state


# ------------------------------------------------------------------------------- DeepSeek MTP


# Targets whose decoder block the DeepSeek MTP loaders build: vLLM's DeepSeekMTP and SGLang's
# DeepseekV3ForCausalLMNextN construct the MTP layer's block from the target's config as a DeepSeek
# (MLA + MoE) layer, so a Llama-family block under model.layers.{L} is read by none of them.


def _not_deepseek(target: LlamaForCausalLM) -> str | None:
    kind = target.config.model_type
    if kind in DEEPSEEK_MODEL_TYPES:
        return None
    return (f"DeepSeek MTP loaders (vLLM DeepSeekMTP, SGLang NextN) build the MTP block as a DeepSeek (MLA + MoE) "
            f"layer from the target's config; this target is {kind!r}, whose layer no such loader reads. Use "
            "--format native (or, for a Qwen3-family target, --format vllm: speculators' own `mtp` layout, which the "
            "speculators library loads and vLLM does not)")


class DeepSeekMTP(Layout):
    name = "deepseek-mtp"
    families = ("deepseek_mtp", "mtp")

    def refuse(self, head: DraftHead) -> str | None:
        why = super().refuse(head) or _not_deepseek(head.target.model) or _needs_postnorm(head, "vLLM / SGLang")
        if why:
            return why
        cfg = head.config
        if cfg.num_layers != 1:
            return f"the DeepSeek MTP module holds one decoder block; this head has {cfg.num_layers}"
        if cfg.dense_block and head.target.model.config.is_moe_layer(head.target.model.config.num_hidden_layers):
            return ("the DeepSeek MTP loaders build the block at model.layers.{L} from the target's config, which "
                    "routes experts there; this head has a dense MLP (head.dense_block): export it as native")
        if cfg.head_type == "mtp" and _norm_flags(cfg) != _norm_flags(HeadConfig(head_type="mtp")):
            return "only an mtp head with the default norm flags maps onto enorm / hnorm / eh_proj / shared_head.norm"
        return None

    @staticmethod
    def _rules(head_type: str, layer: int) -> list[tuple[str, str]]:
        p = f"model.layers.{layer}"
        if head_type == "mtp":
            return [("embed_norm", f"{p}.enorm"), ("hidden_norm", f"{p}.hnorm"), ("fc", f"{p}.eh_proj"),
                    ("norm", f"{p}.shared_head.norm"), ("layers.0", p)]
        return [("enorm", f"{p}.enorm"), ("hnorm", f"{p}.hnorm"), ("eh_proj", f"{p}.eh_proj"),
                ("shared_head", f"{p}.shared_head"), ("layers.0", p)]

    def write(self, head, target):  # noqa: ANN001, ANN201
        n = target.config.num_hidden_layers
        state = split_fused(rename(native_state(head), self._rules(head.config.head_type, n)), head.config)
        # DeepSeek-V3 ships the shared embedding and head inside the MTP layer; loaders may read them there.
        state[f"model.layers.{n}.embed_tokens.weight"] = target.model.embed_tokens.weight.detach().cpu().clone()
        state[f"model.layers.{n}.shared_head.head.weight"] = target.lm_head.weight.detach().cpu().clone()
        config = target_hf_config(target)
        config.update(num_nextn_predict_layers=1, headstart=_meta(head, self.name))
        return config, state

    def tensor_prefix(self, config):  # noqa: ANN001, ANN201
        # An export of ours holds only the MTP layer; a DeepSeek-V3 / R1 checkpoint holds it after its
        # decoder layers: either way it is model.layers.{num_hidden_layers}.
        n = config.get("num_hidden_layers")
        return f"model.layers.{n}." if isinstance(n, int) and not isinstance(n, bool) else None

    def recognise(self, config):  # noqa: ANN001, ANN201
        if config.get("num_nextn_predict_layers") == 1:
            return None
        return f"num_nextn_predict_layers {config.get('num_nextn_predict_layers')!r} (expected 1)"

    def read(self, config, tensors, target):  # noqa: ANN001, ANN201
        why = _not_deepseek(target)
        if why:
            raise AssetError(f"not importable onto this target: {why}")
        n = target.config.num_hidden_layers
        meta = config.get("headstart") or {}
        kind = "mtp" if meta.get("head_type") == "mtp" else "deepseek_mtp"
        p = f"model.layers.{n}"
        shared = (f"{p}.embed_tokens.weight", f"{p}.shared_head.head.weight")
        state = {k: v for k, v in tensors.items() if k not in shared}
        state = rename(join_fused(state), invert(self._rules(kind, n)))
        return _head_config(config, kind, target, postnorm_features=True), state  # what the MTP loaders feed it


# ------------------------------------------------------------------------------------- Medusa


class Medusa(Layout):
    name = "medusa"
    families = ("medusa",)

    @staticmethod
    def _rules(cfg: HeadConfig) -> list[tuple[str, str]]:
        return [(f"heads.{h}.{j}.linear", f"blocks.{h}.layers.{j}") for h in range(cfg.medusa_num_heads)
                for j in range(cfg.medusa_num_layers)] + [("lm_head", "lm_heads.0")]

    def write(self, head, target):  # noqa: ANN001, ANN201
        cfg = head.config
        state = rename(native_state(head), self._rules(cfg))
        d2t = state.pop("d2t")
        vocab = target.config.vocab_size
        if cfg.draft_vocab_size:
            state["token_map"] = torch.arange(d2t.numel()) + d2t  # draft id -> target id
        else:
            state["lm_heads.0.weight"] = target.lm_head.weight.detach().cpu().clone()
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": cfg.hidden_size,
                  "vocab_size": vocab, "num_heads": cfg.medusa_num_heads, "num_hidden_layers": cfg.medusa_num_layers,
                  "truncated_vocab_size": int(d2t.numel()), "medusa_fc_bias": True, "original_lm_head": True,
                  "headstart": _meta(head, self.name)}
        return config, state

    def recognise(self, config):  # noqa: ANN001, ANN201
        if config.get("model_type") == "medusa" or "medusa_num_heads" in config:
            return None
        return f"model_type {config.get('model_type')!r} (expected 'medusa')"

    def read(self, config, tensors, target):  # noqa: ANN001, ANN201
        heads = config_int(config, "num_heads" if "num_heads" in config else "medusa_num_heads")
        layers = config_int(config, "num_hidden_layers" if "num_hidden_layers" in config else "medusa_num_layers", 1)
        if heads > 32 or layers > 16:
            raise AssetError(f"config.json: {heads} Medusa heads x {layers} layers is beyond 32 x 16")
        state = {k.removeprefix("medusa_heads."): v for k, v in tensors.items()}
        vocab = target.config.vocab_size
        truncated = config_int(config, "truncated_vocab_size", vocab) if config.get("truncated_vocab_size") else vocab
        cfg = _head_config(config, "medusa", target, medusa_num_heads=heads, medusa_num_layers=layers)
        token_map = state.pop("token_map", None)
        if token_map is not None and (token_map.is_floating_point() or token_map.dtype == torch.bool
                                      or token_map.numel() != truncated or token_map.min() < 0
                                      or token_map.max() >= vocab):
            raise AssetError(f"token_map must hold {truncated} integer target ids in [0, {vocab})")
        if token_map is not None and token_map.unique().numel() != token_map.numel():
            raise AssetError("token_map maps two draft ids to one target token")
        if token_map is not None and truncated < vocab:
            cfg.draft_vocab_size = truncated
            state["d2t"] = token_map.long() - torch.arange(truncated)
        else:  # the full vocabulary: the head reads through the target's lm_head
            cfg.draft_vocab_size = None
            state.pop("lm_heads.0.weight", None)
            state["d2t"] = torch.zeros(vocab, dtype=torch.int64)
        for h in range(1, heads):
            state.pop(f"lm_heads.{h}.weight", None)  # per-head copies of the same lm_head
        return cfg, rename(state, invert(self._rules(cfg)))


# ------------------------------------------------------------------------------ HF draft model


class HF(Layout):
    name = "hf"
    families = ("draft_lm",)

    def write(self, head, target):  # noqa: ANN001, ANN201
        cfg = head.config
        state = split_fused(rename(native_state(head), [("layers", "model.layers"), ("norm", "model.norm"),
                                                        ("embed_tokens", "model.embed_tokens")]), cfg)
        if cfg.share_target_embeddings:
            state["model.embed_tokens.weight"] = target.model.embed_tokens.weight.detach().cpu().clone()
            state["lm_head.weight"] = target.lm_head.weight.detach().cpu().clone()
        config = _layer_config(head, target)
        config.update(architectures=target_hf_config(target).get("architectures") or ["LlamaForCausalLM"],
                      tie_word_embeddings=False, headstart=_meta(head, self.name))
        return config, state

    def recognise(self, config):  # noqa: ANN001, ANN201
        if config.get("model_type") and "num_hidden_layers" in config and "speculators_model_type" not in config:
            return None
        return "no model_type / num_hidden_layers: not an HF model config"

    def read(self, config, tensors, target):  # noqa: ANN001, ANN201
        state = rename(join_fused(tensors), [("model.layers", "layers"), ("model.norm", "norm"),
                                             ("model.embed_tokens", "embed_tokens")])
        shared = (state["embed_tokens.weight"].shape == target.model.embed_tokens.weight.shape
                  and torch.equal(state["embed_tokens.weight"], target.model.embed_tokens.weight.cpu())
                  and torch.equal(state["lm_head.weight"], target.lm_head.weight.cpu()))
        cfg = _head_config(config, "draft_lm", target, num_layers=config_int(config, "num_hidden_layers"),
                           share_target_embeddings=shared, **_dims(config))
        if cfg.share_target_embeddings:
            state.pop("embed_tokens.weight")
            state.pop("lm_head.weight")
        return cfg, state


LAYOUTS: dict[str, Layout] = {x.name: x for x in (SGLang(), VLLM(), DeepSeekMTP(), Medusa(), HF())}
LAYOUTS["eagle"] = LAYOUTS["sglang"]  # the EAGLE research code's checkpoints use SGLang's names
