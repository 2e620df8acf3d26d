"""A plain HF `LlamaForCausalLM` directory: the draft_lm head as any engine's separate draft model."""

from __future__ import annotations

import torch

from headstart.export.layout import Layout, config_int, join_fused, native_state, rename, split_fused, target_hf_config
from headstart.export.layout_configs import draft_layer_config, export_record, imported_head_config, layer_dims


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
        config = draft_layer_config(head, target)
        config.update(architectures=target_hf_config(target).get("architectures") or ["LlamaForCausalLM"],
                      tie_word_embeddings=False, headstart=export_record(head, self.name))
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
        cfg = imported_head_config(config, "draft_lm", target, num_layers=config_int(config, "num_hidden_layers"),
                                   share_target_embeddings=shared, **layer_dims(config))
        if cfg.share_target_embeddings:
            state.pop("embed_tokens.weight")
            state.pop("lm_head.weight")
        return cfg, state
