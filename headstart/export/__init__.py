"""Export native heads to serving layouts and import them back (formats in `formats.py`).

Every export is checked before it is kept: its tensor names and shapes against what a head of its
config needs, then it is read back by our own importer and must give the head's logits bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from headstart.errors import AssetError
from headstart.export.formats import LAYOUTS
from headstart.export.layout import Layout, check_tensors
from headstart.fileio import apply_umask, atomic_path, check_output_path, read_json_object
from headstart.heads import FAMILIES, DraftHead, PackedBatch, is_head_checkpoint, save_head
from headstart.heads.base import check_compatible
from headstart.models.llama import LlamaForCausalLM

EXPORT_FORMATS = ("sglang", "vllm", "deepseek-mtp", "medusa", "hf", "native")
IMPORT_FORMATS = ("sglang", "vllm", "eagle", "deepseek-mtp", "medusa", "hf")


def is_export(path: str | Path) -> bool:
    """A directory this exporter wrote (so `--force` may replace it)."""
    f = Path(path) / "config.json"
    try:
        return f.is_file() and isinstance(json.loads(f.read_text()).get("headstart", {}).get("export_format"), str)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def _rules(overwrite: bool) -> dict[str, Any]:
    return {"replaces": (lambda p: is_export(p) or is_head_checkpoint(p)) if overwrite else None,
            "hint": "pass --force to replace an earlier export"}


def check_export_output(out: str | Path, overwrite: bool = False) -> Path:
    return check_output_path(out, **_rules(overwrite))


def export_head(head: DraftHead, target: LlamaForCausalLM, fmt: str, out: str | Path, *,
                overwrite: bool = False) -> dict[str, Any]:
    """Write `head` in layout `fmt` under `out`; returns a summary (files, tensors, checks)."""
    if fmt == "native":
        path = save_head(head, out, overwrite=overwrite)
        return {"format": "native", "out": str(path), "tensors": len(head.state_dict()), "roundtrip": "identical"}
    layout = _layout(fmt, EXPORT_FORMATS)
    why = layout.refuse(head)
    if why:
        raise AssetError(f"cannot export a {head.config.head_type} head as {fmt}: {why}")
    config, tensors = layout.write(head, target)
    _check_finite(tensors, f"export as {fmt}")
    with atomic_path(Path(out), **_rules(overwrite)) as tmp:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        apply_umask(tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        back = _read_back(layout, tmp, target)
        same = _same_outputs(head, back)
        if not same:
            raise AssetError(f"export as {fmt}: the checkpoint read back gives other logits than the head; "
                             "nothing was kept (a bug: please report it)")
    return {"format": fmt, "out": str(Path(out).resolve()), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "roundtrip": "identical"}


def import_head(src: str | Path, fmt: str, target: LlamaForCausalLM, out: str | Path, *,
                overwrite: bool = False) -> DraftHead:
    """Read a checkpoint in layout `fmt` and save it as a native head under `out`."""
    layout = _layout(fmt, IMPORT_FORMATS)
    head = _read_back(layout, Path(src), target)
    save_head(head, out, overwrite=overwrite)
    return head


# ------------------------------------------------------------------------------------ helpers


def _layout(fmt: str, allowed: tuple[str, ...]) -> Layout:
    if fmt not in allowed:
        raise AssetError(f"unknown format {fmt!r}; choose one of {', '.join(allowed)}")
    return LAYOUTS[fmt]


def _load_tensors(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(src.glob("*.safetensors"))
    bins = sorted(src.glob("pytorch_model*.bin"))
    if not files and not bins:
        raise AssetError(f"{src}: no *.safetensors or pytorch_model*.bin weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files or bins:
        try:
            part = load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu",
                                                                                   weights_only=True)
        except Exception as e:  # safetensors / pickle raise their own error types for damaged files
            raise AssetError(f"{f}: unreadable ({str(e)[:120]})") from None
        tensors.update(part)
    return tensors


def _read_back(layout: Layout, src: Path, target: LlamaForCausalLM) -> DraftHead:
    """Checkpoint directory -> a head on `target`, every tensor name and shape checked."""
    if not src.is_dir():
        raise AssetError(f"{src}: not a directory")
    config = read_json_object(src / "config.json", "checkpoint config")
    found = layout.recognise(config)
    if found is not None:
        raise AssetError(f"{src}: not a {layout.name} checkpoint: found {found}")
    tensors = _load_tensors(src)
    cfg, state = layout.read(config, tensors, target)
    cfg.target = {}
    try:
        cfg = cfg.resolve(target)
    except (ValueError, AssetError) as e:
        raise AssetError(f"{src}: {e}") from None
    check_compatible(cfg, target, where=str(src / "config.json"))
    weight = target.model.embed_tokens.weight
    head = FAMILIES[cfg.head_type](cfg, target).to(device=weight.device)
    want = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    # Name the tensors as the checkpoint does: re-export a fresh head of this config for the names.
    fresh = layout.write(head, target)[1] if layout.refuse(head) is None else None
    if fresh is not None:
        check_tensors(str(src), tensors, {k: tuple(v.shape) for k, v in fresh.items()}
                      | _optional(tensors, fresh))
    check_tensors(str(src), state, want)
    dtype = next(iter(state.values())).dtype if state else weight.dtype
    head = head.to(dtype=dtype if dtype.is_floating_point else weight.dtype)
    head.load_state_dict({k: v.to(head.state_dict()[k].dtype) for k, v in state.items()}, strict=True)
    return head


def _optional(have: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Tensors a loader tolerates beyond the layout's own (a copy of the target's embedding, t2d)."""
    extra = {}
    for name in ("embed_tokens.weight", "t2d", "token_map", "verifier_lm_head.weight", "verifier_norm.weight"):
        if name in have and name not in fresh:
            extra[name] = tuple(have[name].shape)
    extra.update({k: tuple(v.shape) for k, v in have.items() if k.startswith("lm_heads.") and k not in fresh})
    return extra


def _check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    if not tensors:
        raise AssetError(f"{where}: no tensors")
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t.float()).all():
            raise AssetError(f"{where}: tensor {name} holds NaN or inf values")


def _same_outputs(a: DraftHead, b: DraftHead) -> bool:
    """Both heads on the same random inputs give identical logits."""
    gen = torch.Generator().manual_seed(0)
    t = a.target.model.config
    n = 12
    ids = torch.randint(0, t.vocab_size, (n,), generator=gen)
    device = a.target.model.model.embed_tokens.weight.device
    hidden = torch.randn(n, t.hidden_size, generator=gen).to(device, a.target.model.dtype)
    aux_ids = a.config.aux_layer_ids or []
    aux = torch.randn(n, len(aux_ids), t.hidden_size, generator=gen).to(device, a.target.model.dtype) \
        if aux_ids else None
    batch = PackedBatch(ids.to(device), [5, 7], hidden, aux, None)
    with torch.no_grad():
        ha, _ = a.train_forward(batch)
        hb, _ = b.train_forward(batch)
        return torch.equal(a.compute_logits(ha), b.compute_logits(hb))


__all__ = ["EXPORT_FORMATS", "IMPORT_FORMATS", "check_export_output", "export_head", "import_head", "is_export"]
