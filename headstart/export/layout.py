"""What every serving layout shares: renaming our fused tensors to the engines' names and back, the
config of the target in HF form, and the key-set / shape check (loaders skip unknown names silently,
so a wrong name would load as a random tensor: we check everything ourselves).

A layout maps a native head to (config.json, tensors) and back. Our decoder layers keep q/k/v in one
`qkv_proj` and gate/up in one `gate_up_proj`, and a MoE layer's routed experts stacked in one tensor per
projection; serving engines name them apart.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from headstart.errors import AssetError
from headstart.heads import DraftHead, HeadConfig
from headstart.models.llama import LlamaForCausalLM, read_hf_config
from headstart.models.loading import ONE_EXPERT, STACKED_EXPERTS


class Layout(abc.ABC):
    name: str = ""
    families: tuple[str, ...] = ()  # head types this layout can hold
    optional: tuple[str, ...] = ()  # tensor names a checkpoint of this layout may omit

    def refuse(self, head: DraftHead) -> str | None:
        """Why this layout cannot represent `head` (None when it can)."""
        if head.config.head_type not in self.families:
            return (f"the {self.name} layout holds {', '.join(self.families)} heads, not "
                    f"{head.config.head_type!r}")
        if getattr(head, "has_draft_vocab", False):
            # These layouts predict through the verifier's own (full) lm_head: a server would draft over
            # every token, and the head never learned to rank the ones outside its draft vocabulary.
            return (f"the head drafts over a {head.config.draft_vocab_size}-token draft vocabulary through the "
                    f"target's lm_head rows; the {self.name} layout has no place for that vocabulary (its loader "
                    "reads the verifier's full lm_head). Export it as native, or train it without "
                    "head.draft_vocab_size")
        return None

    def tensor_prefix(self, config: dict[str, Any]) -> str | None:
        """Where this layout's tensors live in a checkpoint (None: every tensor is the head's)."""
        return None

    def tensor_names(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under the names this layout reads (a loader may take several spellings)."""
        return tensors

    @abc.abstractmethod
    def write(self, head: DraftHead, target: LlamaForCausalLM) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """-> (config.json contents, tensors under the serving names)."""

    @abc.abstractmethod
    def recognise(self, config: dict[str, Any]) -> str | None:
        """None if `config` is this layout; else what was found instead (for the error)."""

    @abc.abstractmethod
    def read(self, config: dict[str, Any], tensors: dict[str, torch.Tensor],
             target: LlamaForCausalLM) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
        """-> (the head config, its native state dict). Tensors were already shape-checked."""


# ----------------------------------------------------------------------------- name mapping


def split_fused(state: dict[str, torch.Tensor], cfg: HeadConfig) -> dict[str, torch.Tensor]:
    """qkv_proj -> q_proj/k_proj/v_proj and gate_up_proj -> gate_proj/up_proj (weights and biases)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {}
    for name, t in unstack_experts(state).items():
        if ".qkv_proj." in name:
            for part, block in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[name.replace(".qkv_proj.", f".{part}.")] = block.contiguous()
        elif ".gate_up_proj." in name:
            for part, block in zip(("gate_proj", "up_proj"), t.chunk(2, dim=-2 if t.dim() > 1 else 0)):  # bias: 1-D
                out[name.replace(".gate_up_proj.", f".{part}.")] = block.contiguous()
        else:
            out[name] = t
    return out


def unstack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked routed experts (headstart.nn.experts: "...experts.down_proj.weight" (E, D, I)) -> one tensor per
    expert ("...experts.{e}.down_proj.weight"), as checkpoints and serving engines name them."""
    out = {}
    for name, t in state.items():
        m = STACKED_EXPERTS.search(name)
        if m is None:
            out[name] = t
            continue
        for e, w in enumerate(t.unbind(0)):
            out[f"{name[:m.start()]}.experts.{e}.{m.group(1)}.weight"] = w.contiguous()
    return out


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `unstack_experts` (experts 0..E-1 of a projection must all be there)."""
    out, groups = {}, {}
    for name, t in state.items():
        m = ONE_EXPERT.search(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(f"{name[:m.start()]}.experts.{m.group(2)}.weight", {})[int(m.group(1))] = t
    for name, parts in groups.items():
        if sorted(parts) != list(range(len(parts))):
            missing = sorted(set(range(max(parts) + 1)) - set(parts))
            raise AssetError(f"{name}: experts {missing} are missing (the checkpoint holds {sorted(parts)})")
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def join_fused(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `split_fused`."""
    out, done = {}, set()
    for name, t in state.items():
        if name in done:
            continue
        if ".q_proj." in name and name.replace(".q_proj.", ".k_proj.") in state:  # MLA's q_proj stands alone
            parts = [name.replace(".q_proj.", f".{p}.") for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat([state[p] for p in parts])
            done.update(parts)
        elif ".gate_proj." in name:
            parts = [name.replace(".gate_proj.", f".{p}.") for p in ("gate_proj", "up_proj")]
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([state[p] for p in parts])
            done.update(parts)
        elif ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue  # taken with its q_proj / gate_proj
        else:
            out[name] = t
    return stack_experts(out)


def rename(state: dict[str, torch.Tensor], rules: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Replace the longest matching prefix of each name (rules: (from, to); '' matches everything)."""
    out = {}
    rules = sorted(rules, key=lambda r: -len(r[0]))
    for name, t in state.items():
        for src, dst in rules:
            if src == "" or name == src or name.startswith(src + "."):
                name = dst + name[len(src):] if src else dst + name
                break
        out[name] = t
    return out


def invert(rules: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(dst, src) for src, dst in rules]


def native_state(head: DraftHead) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}


def target_hf_config(target: LlamaForCausalLM) -> dict[str, Any]:
    """The target's config.json as HF wrote it (our own fields when the directory is unknown)."""
    if target.source_dir is not None and (target.source_dir / "config.json").is_file():
        cfg = read_hf_config(target.source_dir)
        cfg.pop("quantization_config", None)
        return cfg
    c = target.config
    return {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "hidden_act": c.hidden_act,
            "max_position_embeddings": c.max_position_embeddings}


def check_tensors(where: str, have: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]]) -> None:
    """Refuse missing, unexpected or mis-shaped tensors, naming each (and both shapes)."""
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing[:6]}" + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else ""))
        if extra:
            parts.append(f"unexpected {extra[:6]}" + (f" (+{len(extra) - 6} more)" if len(extra) > 6 else ""))
        raise AssetError(f"{where}: tensor names do not fit this layout: {'; '.join(parts)}")
    for name, shape in want.items():
        if tuple(have[name].shape) != tuple(shape):
            raise AssetError(f"{where}: tensor {name} has shape {list(have[name].shape)}, this target needs "
                             f"{list(shape)}")


def require(config: dict[str, Any], key: str, where: str) -> Any:
    if key not in config:
        raise AssetError(f"{where}: config.json has no {key!r}")
    return config[key]


def config_int(config: dict[str, Any], key: str, default: Any = None, *, least: int = 1) -> int:
    """An integer config field, or an error naming the key and the value found."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise AssetError(f"config.json: {key} must be an integer >= {least}, got {str(value)[:40]!r}")
    return value


def config_bool(config: dict[str, Any], key: str) -> bool:
    """A boolean config flag (absent: false, as the engines read it), or an error naming the key."""
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise AssetError(f"config.json: {key} must be true or false, got {str(value)[:40]!r}")
    return value


def config_dict(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise AssetError(f"config.json: {key} must be an object, got {type(value).__name__}")
    return value


def config_ids(value: Any, key: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(j, int) and not isinstance(j, bool) for j in value):
        raise AssetError(f"config.json: {key} must be a list of layer ids, got {str(value)[:40]!r}")
    return value
