"""SGLang's EAGLE layouts: `LlamaForCausalLMEagle3` (eagle3) and `LlamaForCausalLMEagle` (eagle1), from
the EAGLE research code; its DFlash layout is in sglang_dflash.py, which this class hands dflash heads to.

SGLang names an aux layer by the layer whose OUTPUT it captures (it captures at id + 1), ours by the
hidden state ENTERING a layer (HF hidden_states[j]): an export writes j - 1 and an import reads k + 1.
"""

from __future__ import annotations

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
    split_fused,
)
from headstart.export.layout_configs import draft_layer_config, export_record, imported_head_config, layer_dims
from headstart.heads import DraftHead
from headstart.heads.config import EAGLE_FLAGS, default_aux_layers

# EAGLE-3.1 flags SGLang's LlamaForCausalLMEagle3 lacks: its model (sglang/srt/models/llama_eagle3.py) builds
# fc_norm.{i} when `fc_norm` is set and feeds back the post-norm state when `norm_output` is, but has no
# norm over the concatenated aux states (no input_norm) and always keeps the un-normed fc output as the
# first layer's residual.
SGLANG_MISSING_FLAGS = ("norm_before_fc", "norm_before_residual")
_SGLANG_MISSING_NORM = {"norm_before_fc": "an RMSNorm over the concatenated aux states before fc",
                        "norm_before_residual": "hidden_norm on the first layer's residual"}


def _no_qk_norm(head: DraftHead, name: str) -> str | None:
    if head.config.head_type != "medusa" and any(".q_norm." in k for k in head.state_dict()):
        return f"{name}'s Llama decoder layer has no q/k norms, which this target family's layers have"
    return None


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
            return sglang_dflash.write(head, target, draft_layer_config(head, target, "qwen3"),
                                       export_record(head, self.name))
        state = split_fused(rename(native_state(head), self._rules(cfg.head_type)), cfg)
        config = draft_layer_config(head, target, "llama")
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
        config["headstart"] = export_record(head, self.name)
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
            return imported_head_config(config, "dflash", target, **fields, **layer_dims(config)), state
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
            cfg = imported_head_config(config, "eagle3", target, aux_layer_ids=aux, draft_vocab_size=vocab, **flags,
                                       **layer_dims(config))
            cfg.draft_vocab_size = vocab
            state.pop("embed_tokens.weight", None)  # EAGLE-3 checkpoints may carry the target's embedding
        else:
            cfg = imported_head_config(config, "eagle1", target,
                                       num_layers=config_int(config, "num_hidden_layers", 1), **layer_dims(config))
            state.pop("embed_tokens.weight", None)
            state.pop("lm_head.weight", None)
            if cfg.fc_bias is False and "fc.bias" in state:  # our head without a bias, written with a zero one
                if state["fc.bias"].any():
                    raise AssetError("fc.bias is not zero, but the recorded head config says the head has no fc "
                                     "bias (head.fc_bias: false)")
                del state["fc.bias"]
        return cfg, state
