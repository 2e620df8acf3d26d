"""SGLang's DFlash layout (`--speculative-algorithm DFLASH`), checked against its sources:
sglang/srt/models/dflash.py (DFlashDraftModel) and sglang/srt/speculative/dflash_utils.py.

    config.json  architectures ["DFlashDraftModel"], the layer's Qwen3-style fields (hidden_size,
                 num_hidden_layers, heads, head_dim, intermediate_size, rms_norm_eps, rope, hidden_act silu)
                 and dflash_config {target_layer_ids, block_size, mask_token_id, num_target_layers}
    tensors      fc.weight [d, K d], hidden_norm.weight, layers.{i}.{input_layernorm, post_attention_layernorm,
                 self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.weight, norm.weight
                 (SGLang's loader also takes them under `model.`, and so does our import)

The model holds no embedding and no lm_head: it reads the target's, over the whole vocabulary, so a
head with a draft vocabulary has no place there. Its layers always apply q/k norms and take SiLU.

Layer ids, off by one: dflash_utils.build_target_layer_ids documents that DFlash uses the hidden
state AFTER each selected target layer (HF-style), and every target's set_dflash_layers_to_capture
captures "before layer k + 1" for id k. So SGLang's id k is HF hidden_states[k + 1], which is our aux
id k + 1 (ours name the state ENTERING a layer): we write j - 1 and read k + 1. Our aux 0 (the
embedding output) is no layer's output and cannot be named there.
"""

from __future__ import annotations

from typing import Any

import torch

from headstart.errors import AssetError
from headstart.export.layout import config_dict, config_ids, config_int, join_fused, native_state, split_fused
from headstart.heads import DraftHead
from headstart.models.llama import LlamaForCausalLM

ARCHITECTURE = "DFlashDraftModel"


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SGLang's ids when dflash_config has none (dflash_utils.build_target_layer_ids): one per draft layer,
    spread evenly over target layers 1 .. L - 3 (a single layer: L // 2)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise AssetError(f"config.json: no dflash_config.target_layer_ids, and SGLang's default needs a target "
                         f"of at least 4 layers (this one has {num_target_layers})")
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def plain_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors under our names: SGLang's loader also takes every name under `model.`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        plain = name.removeprefix("model.")
        if plain in out:
            raise AssetError(f"model.{plain} and {plain} are both present; SGLang's loader reads them as one tensor")
        out[plain] = t
    return out


def refuse(head: DraftHead) -> str | None:
    cfg = head.config
    if cfg.draft_vocab_size:
        return (f"the head drafts over a {cfg.draft_vocab_size}-token draft vocabulary; SGLang's DFlashDraftModel "
                "has no lm_head or d2t of its own (it predicts through the target's lm_head over the whole "
                "vocabulary): train it without head.draft_vocab_size, or export it with --format vllm")
    if 0 in cfg.aux_layer_ids:
        return ("SGLang's dflash_config.target_layer_ids name a target layer's OUTPUT: aux 0 (the embedding) is no "
                "layer's output; choose head.aux_layer_ids >= 1")
    if head.target.model.config.hidden_act != "silu":
        return f"SGLang's DFlash MLP takes SiLU only; this target's activation is {head.target.model.config.hidden_act}"
    return None


def write(head: DraftHead, target: LlamaForCausalLM, layer_config: dict[str, Any],
          meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg = head.config
    state = split_fused(native_state(head), cfg)
    config = dict(layer_config)
    config.update(architectures=[ARCHITECTURE], attention_bias=False, tie_word_embeddings=False,
                  block_size=cfg.block_size,  # also read from the top level; dflash_config's wins
                  dflash_config={"target_layer_ids": [j - 1 for j in cfg.aux_layer_ids],
                                 "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                                 "num_target_layers": target.config.num_hidden_layers},
                  headstart=meta)
    return config, state


def read(config: dict[str, Any], tensors: dict[str, torch.Tensor],
         target: LlamaForCausalLM) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """-> (HeadConfig fields, native state)."""
    if not isinstance(config.get("dflash_config"), dict):
        raise AssetError("config.json: no dflash_config object (SGLang's DFlashDraftModel reads its target_layer_ids, "
                         "block_size and mask_token_id there); is this a DFlash checkpoint of SGLang's layout?")
    dflash = config_dict(config, "dflash_config")
    n = target.config.num_hidden_layers
    trained = dflash.get("num_target_layers", config.get("num_target_layers"))
    if trained is not None and (isinstance(trained, bool) or not isinstance(trained, int)):
        raise AssetError(f"config.json: dflash_config.num_target_layers must be an integer, got {str(trained)[:20]!r}")
    if trained is not None and trained != n:
        raise AssetError(f"config.json: dflash_config.num_target_layers is {trained}, this target has {n} "
                         "layers (a head for another target)")
    layers = config_int(config, "num_hidden_layers")
    ids = config_ids(dflash.get("target_layer_ids", config.get("target_layer_ids")), "dflash_config.target_layer_ids")
    if ids == []:  # SGLang refuses it too; only an absent key takes its default
        raise AssetError("config.json: dflash_config.target_layer_ids is empty; SGLang refuses that (the head fuses "
                         "at least one target layer): name the layers, or leave the key out for SGLang's default")
    ids = ids if ids is not None else default_target_layers(n, layers)
    if any(not 0 <= k < n for k in ids):
        raise AssetError(f"config.json: dflash_config.target_layer_ids {ids[:8]} are outside this target's layers "
                         f"0..{n - 1}")
    block = dflash.get("block_size", config.get("block_size", 16))  # 16: DFlashDraftModel's default
    top = config.get("block_size")
    if "block_size" in dflash and top is not None and top != block:
        raise AssetError(f"config.json: block_size {str(top)[:20]} and dflash_config.block_size {str(block)[:20]} "
                         "disagree; SGLang reads dflash_config's, our importer will not guess: make them equal")
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise AssetError(f"config.json: dflash_config.block_size must be an integer >= 2, got {str(block)[:20]!r}")
    mask = dflash.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int):
        raise AssetError("config.json: dflash_config.mask_token_id must be a token id (SGLang would look the mask "
                         f"token up in the tokenizer, which an import does not read), got {str(mask)[:20]!r}")
    if not 0 <= mask < target.config.vocab_size:
        raise AssetError(f"config.json: dflash_config.mask_token_id {mask} is outside the target's vocabulary "
                         f"(0..{target.config.vocab_size - 1})")
    if config.get("attention_bias"):
        raise AssetError("config.json: attention_bias is true; our dflash layers have no biases")
    state = join_fused(tensors)
    extra = sorted(k for k in state if k.startswith(("embed_tokens.", "lm_head.")))
    if extra:
        raise AssetError(f"{extra[0]} is present; SGLang's DFlashDraftModel reads the target's embedding and lm_head, "
                         "so a checkpoint of its layout holds neither")
    return {"aux_layer_ids": [k + 1 for k in ids], "num_layers": layers, "block_size": block,
            "mask_token_id": mask}, state


__all__ = ["ARCHITECTURE", "default_target_layers", "plain_names", "read", "refuse", "write"]
