"""vLLM's layouts: the speculators format (`speculators` 0.9.0 `eagle3`, `mtp` and `dflash`, which vLLM
loads as speculators checkpoints) and, for eagle1 heads, vLLM's own EAGLE directory
(`EagleLlamaForCausalLM`). vLLM's aux-layer ids name the hidden state ENTERING a layer, as ours do.
"""

from __future__ import annotations

from typing import Any

import torch

from headstart.errors import AssetError
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
from headstart.export.layout_configs import (
    draft_layer_config,
    export_record,
    imported_head_config,
    layer_dims,
    norm_flags,
    refuse_prenorm,
)
from headstart.heads import DraftHead, HeadConfig
from headstart.heads.config import EAGLE31_FLAGS, EAGLE_FLAGS, default_aux_layers
from headstart.models.llama import LlamaForCausalLM

SPECULATORS_VERSION = "0.9.0"

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
            why = refuse_prenorm(head, "vLLM")
            if why:
                return why
            flags = norm_flags(cfg)
            if flags != norm_flags(HeadConfig(head_type="mtp")) or cfg.num_layers != 1:
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
            config = {**draft_layer_config(head, target, "llama"), "architectures": [VLLM_EAGLE1_ARCH],
                      "tie_word_embeddings": False, "headstart": export_record(head, self.name)}
            return config, split_fused(native_state(head), cfg)
        family = "qwen3" if cfg.target.get("model_type") == "qwen3" else "llama"
        layer = draft_layer_config(head, target, family)
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
        config["headstart"] = export_record(head, self.name)
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
        layer = draft_layer_config(head, target, "qwen3")
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
                  "headstart": export_record(head, self.name)}
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
        cfg = imported_head_config(config, "dflash", target, aux_layer_ids=list(ids) if ids else None,
                                   num_layers=config_int(layer, "num_hidden_layers", 1),
                                   block_size=config_int(config, "block_size", 8, least=2), mask_token_id=mask,
                                   draft_vocab_size=vd if vd != vocab else None, **layer_dims(layer))
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
            cfg = imported_head_config(config, "eagle1", target,
                                       num_layers=config_int(config, "num_hidden_layers", 1), fc_bias=False,
                                       **layer_dims(config))
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
            cfg = imported_head_config(
                config, "eagle3", target, aux_layer_ids=list(ids) if ids else default_aux_layers(n),
                num_layers=config_int(layer, "num_hidden_layers", 1), **flags, **layer_dims(layer))
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
            cfg = imported_head_config(config, "mtp", target, postnorm_features=True,  # what vLLM feeds it
                                       **layer_dims(layer))
            state.pop("lm_head.weight", None)
        return cfg, state
