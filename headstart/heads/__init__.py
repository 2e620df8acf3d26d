"""Draft heads: one file per family, one definition each.

| type           | what                                                        | file            |
|----------------|-------------------------------------------------------------|-----------------|
| `mtp`          | EAGLE head with RMSNorm restored (pre-norm features)         | eagle.py        |
| `eagle1`       | the original EAGLE head (post-norm features, no norms)       | eagle.py        |
| `deepseek_mtp` | DeepSeek-V3 MTP module                                       | deepseek_mtp.py |
| `eagle3`       | EAGLE-3: 3 fused target layers, reduced draft vocabulary     | eagle3.py       |
| `medusa`       | k residual-MLP heads                                         | medusa.py       |
| `draft_lm`     | a small standalone LM for draft-target decoding              | draft_lm.py     |
| `dflash`       | DFlash: a block of drafts in one non-causal forward          | dflash.py       |
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from headstart.config import HeadSection
from headstart.errors import AssetError
from headstart.heads.base import DraftHead, PackedBatch, Shifted, shift_for_head, zero_output_projections
from headstart.heads.checkpoint import (
    _read_head_config,
    check_head_files,
    is_head_checkpoint,
    load_head_state,
    read_head_config,
    save_head,
)
from headstart.heads.config import HEAD_TYPES, HeadConfig, check_compatible
from headstart.heads.deepseek_mtp import DeepSeekMTPHead
from headstart.heads.dflash import DFlashHead
from headstart.heads.draft_lm import DraftLM
from headstart.heads.eagle import EagleHead
from headstart.heads.eagle3 import Eagle3Head
from headstart.heads.medusa import MedusaHead
from headstart.heads.vocab import build_vocab_maps, draft_to_target
from headstart.models.llama import LlamaForCausalLM

FAMILIES: dict[str, type[DraftHead]] = {
    "mtp": EagleHead, "eagle1": EagleHead, "deepseek_mtp": DeepSeekMTPHead, "eagle3": Eagle3Head,
    "medusa": MedusaHead, "draft_lm": DraftLM, "dflash": DFlashHead,
}


def head_config_from_recipe(section: HeadSection) -> HeadConfig:
    """The recipe's `head:` section -> a HeadConfig (dimensions still to be resolved on a target)."""
    return HeadConfig(
        head_type=section.type, num_layers=section.num_layers, aux_layer_ids=section.aux_layer_ids,
        draft_vocab_size=section.draft_vocab_size, medusa_num_heads=section.medusa_num_heads,
        medusa_num_layers=section.medusa_num_layers, postnorm_features=section.postnorm_features,
        dense_block=section.dense_block, block_size=section.block_size, mask_token_id=section.mask_token_id,
        norm_before_fc=section.norm_before_fc, fc_norm=section.fc_norm,
        norm_before_residual=section.norm_before_residual, norm_output=section.norm_output,
        fc_bias=section.fc_bias,
    )


INITS = ("copy", "copy_zero_out")


def copies_target(head: HeadSection) -> bool:
    """Whether training starts the head from the target's layers: head.init_from_target, unless
    head.init_from starts it from a trained head."""
    return head.init_from_target and not head.init_from


def start_from_head(head: DraftHead, path: str | Path, target: LlamaForCausalLM) -> tuple[str, str]:
    """Replace a new head's weights (and draft vocabulary) by those of the trained head checkpoint at
    `path` (head.init_from): its files are checked as `load_head` checks them, and its shape must be
    `head`'s, key by key. A head saved for another target of the same shape is accepted (training adapts
    it). Returns the checkpoint's weights sha256 and the fingerprint of the target it was saved for."""
    path = Path(path).expanduser()
    where = f"head.init_from {path}"
    if path.is_file():
        raise AssetError(f"{where}: a file; name the head checkpoint's directory (the one holding config.json and "
                         "model.safetensors)")
    if not path.is_dir():
        raise AssetError(f"{where}: no such directory (a head checkpoint: config.json + model.safetensors)")
    cfg, sha = _checked_config(path, target)
    have, want = dataclasses.asdict(cfg), dataclasses.asdict(head.config)
    del have["target"], want["target"]
    recipe_keys = {f.name for f in dataclasses.fields(HeadSection)}
    for key in ["head_type", *sorted(set(have) | set(want))]:  # the family first: a family names the rest
        if have.get(key) != want.get(key):
            name = "type" if key == "head_type" else key
            fix = (f"set head.{name} to the checkpoint's" if name in recipe_keys else
                   "not a recipe key: the checkpoint's head has another shape than this recipe builds on this "
                   "target, and cannot be fine-tuned by it")
            raise AssetError(f"{where}: its {key} is {str(have.get(key))[:60]} but the recipe's head has "
                             f"{str(want.get(key))[:60]} ({fix})")
    load_head_state(head, path)
    return sha, str(cfg.target.get("fingerprint"))


def init_copied_layers(head: HeadSection) -> list[int]:
    """The target's decoder layers a head's init_from_target copies (negative: from the end): a
    draft_lm's first head.num_layers, a chain head's last ones, none for Medusa."""
    n = max(head.num_layers, 1)
    if not copies_target(head) or head.type == "medusa":
        return []
    return list(range(n)) if head.type == "draft_lm" else list(range(-n, 0))


def build_head(config: HeadConfig, target: LlamaForCausalLM, init_from_target: bool = True,
               init: str = "copy") -> DraftHead:
    """A head tied to `target`, in the target's dtype and on its device. With `init_from_target`,
    `init` = "copy" starts from the target's weights where shapes allow (see each family's
    `init_from_target`); "copy_zero_out" also zeroes the copied layers' output projections, so the
    decoder layers start as the identity (benchmarks/init.py compares the two)."""
    if init not in INITS:
        raise ValueError(f"unknown head init {init!r}; choose one of {', '.join(INITS)}")
    cfg = config.resolve(target)
    weight = target.model.embed_tokens.weight
    head = FAMILIES[cfg.head_type](cfg, target).to(device=weight.device, dtype=weight.dtype)
    if init_from_target:
        if getattr(target, "tp", None) is not None and target.tp.enabled:
            raise ValueError("init_from_target copies the target's layers, and this target is one tensor-parallel "
                             "shard: build the head on the whole target (tensor-parallel size 1), or load a "
                             "trained head (load_head) to speculate under tensor parallelism")
        head.init_from_target(target)
        if init == "copy_zero_out" and hasattr(head, "layers"):
            zero_output_projections(head.layers)
    return head


def _checked_config(path: str | Path, target: LlamaForCausalLM) -> tuple[HeadConfig, str]:
    """A checkpoint's config and weights sha256, its files checked before the config builds anything (an
    edited config.json is refused here) and the config checked against `target`."""
    cfg, sha = _read_head_config(path)
    check_head_files(path, cfg, sha)
    check_compatible(cfg, target, where=str(Path(path) / "config.json"))
    return cfg, sha


def load_head(path: str | Path, target: LlamaForCausalLM, *, allow_other_target: bool = False) -> DraftHead:
    """Load a native checkpoint, its weights checked against the recorded sha256. A head made for
    another target is refused with both values named; one made for a target of the same shape but
    other weights is refused unless `allow_other_target` (then a warning)."""
    cfg, _ = _checked_config(path, target)
    recorded, actual = cfg.target.get("fingerprint"), target.fingerprint()
    if recorded and recorded != actual:
        msg = (f"{path}: the head was trained for target {recorded[:12]}…, this target is {actual[:12]}… (same "
               "shape, other weights)")
        if not allow_other_target:
            raise AssetError(msg + "; pass --allow-other-target to use it anyway")
        import warnings

        warnings.warn(msg + "; acceptance may be poor", stacklevel=2)
    weight = target.model.embed_tokens.weight
    head = FAMILIES[cfg.head_type](cfg, target).to(device=weight.device, dtype=weight.dtype)
    load_head_state(head, path)
    return head


__all__ = [
    "FAMILIES", "HEAD_TYPES", "DraftHead", "HeadConfig", "PackedBatch", "Shifted", "build_head",
    "head_config_from_recipe", "build_vocab_maps", "copies_target", "draft_to_target", "is_head_checkpoint",
    "load_head", "read_head_config", "start_from_head",
    "save_head", "shift_for_head",
]
