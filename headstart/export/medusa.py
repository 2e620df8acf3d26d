"""vLLM's Medusa layout (`Medusa`): `blocks.{h}.layers.{j}`, `lm_heads.0` and, with a draft vocabulary,
`token_map` (draft id -> target id)."""

from __future__ import annotations

import torch

from headstart.errors import AssetError
from headstart.export.layout import Layout, config_int, invert, native_state, rename
from headstart.export.layout_configs import export_record, imported_head_config
from headstart.heads import HeadConfig


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
                  "headstart": export_record(head, self.name)}
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
        cfg = imported_head_config(config, "medusa", target, medusa_num_heads=heads, medusa_num_layers=layers)
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
