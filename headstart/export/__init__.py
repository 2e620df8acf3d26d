"""Export native heads to serving layouts and import them back (one file per format, registered in `formats.py`).

Every export is checked before it is kept: its tensor names and shapes against what a head of its
config needs, then it is read back by our own importer and must give the head's logits bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from headstart.errors import AssetError, HeadstartError
from headstart.export.formats import LAYOUTS
from headstart.export.layout import Layout, check_tensors
from headstart.fileio import apply_umask, atomic_path, check_output_path, read_json_object
from headstart.heads import FAMILIES, DraftHead, HeadConfig, PackedBatch, is_head_checkpoint, save_head
from headstart.heads.checkpoint import NATIVE_MARK
from headstart.heads.config import EAGLE31_FLAGS, check_compatible
from headstart.models.llama import LlamaForCausalLM
from headstart.models.loading import (
    SCALE_SUFFIX,
    check_fp8_tensor,
    dequantise_fp8,
    empty_weight_map,
    fp8_block_size,
    fp8_format,
)

EXPORT_FORMATS = ("sglang", "vllm", "deepseek-mtp", "medusa", "hf", "native")
IMPORT_FORMATS = ("sglang", "vllm", "eagle", "deepseek-mtp", "medusa", "hf")


def is_export(path: str | Path) -> bool:
    """A directory this exporter wrote (so `--force` may replace it)."""
    f = Path(path) / "config.json"
    try:
        return f.is_file() and isinstance(json.loads(f.read_text()).get("headstart", {}).get("export_format"), str)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def _is_native_export(path: str | Path) -> bool:
    return is_head_checkpoint(path) and (Path(path) / NATIVE_MARK).is_file()


# What an export directory holds; --force replaces one only when it holds nothing else.
EXPORT_FILES = {"config.json", "model.safetensors"}
NATIVE_FILES = EXPORT_FILES | {NATIVE_MARK}


def _rules(overwrite: bool, native: bool = False, out: str | Path | None = None) -> dict[str, Any]:
    replaceable = _is_native_export if native else is_export
    if overwrite:
        hint = "it is not an earlier export of this format; choose a new --out"
    elif out is not None and replaceable(out):
        hint = "it is an earlier export: pass --force to replace it"
    else:
        hint = "choose a new --out"
    return {"replaces": replaceable if overwrite else None, "hint": hint}


def check_export_output(out: str | Path, overwrite: bool = False, *, source: str | Path | None = None,
                        native: bool = False) -> Path:
    """Refuse an output path before any work: never the head being exported, and with --force only
    a directory an earlier export wrote (a native export: a head checkpoint)."""
    if source is not None:
        out_r, src_r = Path(out).resolve(), Path(source).resolve()
        if out_r == src_r or out_r in src_r.parents:
            raise AssetError(f"{out}: it holds the head being exported; choose another --out")
        if src_r in out_r.parents:
            raise AssetError(f"{out}: it is inside the head being exported ({source}); choose another --out")
    path = check_output_path(out, **_rules(overwrite, native, out))
    if overwrite and path.is_dir() and any(path.iterdir()):
        foreign = sorted(p.name for p in path.iterdir() if p.name not in (NATIVE_FILES if native else EXPORT_FILES))
        if foreign:
            listed = ", ".join(foreign[:5]) + (f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else "")
            raise AssetError(f"{path}: an earlier export, but it also holds {listed}, which the exporter did not "
                             "write; --force would delete them: move them out, or choose a new --out")
    return path


def export_head(head: DraftHead, target: LlamaForCausalLM, fmt: str, out: str | Path, *,
                overwrite: bool = False, source: str | Path | None = None) -> dict[str, Any]:
    """Write `head` in layout `fmt` under `out`; returns a summary (files, tensors, checks)."""
    check_export_output(out, overwrite, source=source, native=fmt == "native")
    if fmt == "native":
        _check_finite(dict(head.state_dict()), "export as native")
        if Path(out).exists() and overwrite and not _is_native_export(out):
            raise AssetError(f"{out}: not an earlier native export; --force replaces only those")
        path = save_head(head, out, overwrite=overwrite)
        (path / NATIVE_MARK).write_text("a native export written by `headstart export`\n")
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
        if not _same_outputs(head, back):
            raise AssetError(f"export as {fmt}: the checkpoint read back gives other logits or output states "
                             "(what the next draft step is fed) than the head; nothing was kept (a bug: please "
                             "report it)")
    return {"format": fmt, "out": str(Path(out).resolve()), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "roundtrip": "identical"}


def import_head(src: str | Path, fmt: str, target: LlamaForCausalLM, out: str | Path, *,
                overwrite: bool = False, allow_other_target: bool = False) -> DraftHead:
    """Read a checkpoint in layout `fmt` and save it as a native head under `out`."""
    layout = _layout(fmt, IMPORT_FORMATS)
    head = _read_back(layout, Path(src), target, allow_other_target=allow_other_target)
    save_head(head, out, overwrite=overwrite)
    return head


# ------------------------------------------------------------------------------------ helpers


def _layout(fmt: str, allowed: tuple[str, ...]) -> Layout:
    if fmt not in allowed:
        raise AssetError(f"unknown format {fmt!r}; choose one of {', '.join(allowed)}")
    return LAYOUTS[fmt]


def _load_tensors(src: Path, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: one weights file, or the files its safetensors index lists; with
    `prefix`, only the tensors named under it, read one at a time (a whole DeepSeek-V3 checkpoint
    holds its MTP layer among 671 B other parameters)."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise AssetError(f"{index}: no weight_map")
        if not weight_map:
            raise AssetError(empty_weight_map(index))
        names = sorted(set(map(str, weight_map.values())))
        for name in names:  # plain file names of this checkpoint (lexically: an HF snapshot's files are symlinks)
            if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
                raise AssetError(f"{index}: weight_map names {name[:80]!r}, which is not a file directly inside {src}")
        files = [src / name for name in names]
    else:
        files = sorted(src.glob("*.safetensors")) or sorted(src.glob("pytorch_model*.bin"))
        if len(files) > 1:
            raise AssetError(f"{src}: several weight files ({', '.join(f.name for f in files[:4])}) and no "
                             "model.safetensors.index.json saying which to read")
    if not files:
        raise AssetError(f"{src}: no *.safetensors or pytorch_model*.bin weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            if f.suffix == ".safetensors" and prefix is not None:
                from safetensors import safe_open

                with safe_open(str(f), framework="pt") as handle:
                    part = {k: handle.get_tensor(k) for k in handle.keys() if k.startswith(prefix)}
            else:
                part = load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu",
                                                                                       weights_only=True)
        except Exception as e:  # safetensors / pickle raise their own error types for damaged files
            raise AssetError(f"{f}: unreadable ({str(e)[:120]})") from None
        if prefix is not None:
            part = {k: v for k, v in part.items() if k.startswith(prefix)}
        if not isinstance(part, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in part.items()):
            raise AssetError(f"{f}: not a mapping of tensor names to tensors")
        dup = sorted(set(part) & set(tensors))
        if dup:
            raise AssetError(f"{f}: tensors {dup[:4]} also appear in another weights file")
        tensors.update(part)
    return tensors


def _dequantised(tensors: dict[str, torch.Tensor], config: dict[str, Any], src: Path) -> dict[str, torch.Tensor]:
    """Block-scaled FP8 weights (DeepSeek-V3/R1's MTP layer as released) in fp32, their scales dropped, as
    the target loader reads them (models/loading.py); other tensors as they are."""
    fp8 = [n for n, t in tensors.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if not fp8:
        return tensors
    where = str(src / "config.json")
    block = fp8_block_size(config, where)
    if block is None:
        raise AssetError(f"{src}: {fp8[0]} has dtype {tensors[fp8[0]].dtype} and {where} has no quantization_config "
                         "giving its weight_block_size; import takes fp32, bf16 or fp16 weights, or block-scaled "
                         "FP8 ones with their _scale_inv and that config (as DeepSeek-V3 ships its MTP layer)")
    out = dict(tensors)
    for name in fp8:
        scale = out.pop(name + SCALE_SUFFIX, None)
        if scale is None:
            raise AssetError(f"{src}: tensor {name!r} is FP8 but the checkpoint has no {name + SCALE_SUFFIX!r}; "
                             "cast without its block scales it would be silently wrong")
        w = out[name]
        blocks = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])) if w.ndim == 2 else None
        if blocks is None or tuple(scale.shape) != blocks:
            raise AssetError(f"{src}: {name + SCALE_SUFFIX!r} has shape {tuple(scale.shape)}, but {name!r} "
                             f"{tuple(w.shape)} in blocks of {list(block)} needs {blocks}")
        check_fp8_tensor(name, w, scale, fp8_format(config), str(src), block)
        out[name] = dequantise_fp8(w, scale, block)
    return out


def _read_back(layout: Layout, src: Path, target: LlamaForCausalLM, *,
               allow_other_target: bool = False) -> DraftHead:
    """Checkpoint directory -> a head on `target`, every tensor name, shape, dtype and value checked."""
    if not src.is_dir():
        raise AssetError(f"{src}: not a directory")
    if not (src / "config.json").is_file():
        raise AssetError(f"{src}: no config.json; not a checkpoint directory")
    try:
        config = read_json_object(src / "config.json", "checkpoint config")
    except HeadstartError as e:
        raise AssetError(str(e)) from None
    found = layout.recognise(config)
    if found is not None:
        raise AssetError(f"{src}: not a {layout.name} checkpoint: found {found}")
    _check_target(config, target, src, allow_other_target)
    tensors = layout.tensor_names(config, _dequantised(_load_tensors(src, layout.tensor_prefix(config)), config, src))
    if not tensors:
        raise AssetError(f"{src}: no tensors under {layout.tensor_prefix(config)!r}")
    _check_finite(tensors, str(src))
    for name, t in tensors.items():
        if t.is_floating_point() and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise AssetError(f"{src}: {name} has dtype {t.dtype}; import takes fp32, bf16 or fp16 weights")
    try:
        cfg, state = layout.read(config, tensors, target)
        if isinstance(config.get("headstart"), dict):  # what a serving engine reads must agree with our record
            bare, _ = layout.read({k: v for k, v in config.items() if k != "headstart"}, tensors, target)
            for key in ("aux_layer_ids", "num_layers", "medusa_num_heads", "medusa_num_layers", "block_size",
                        "mask_token_id", "draft_vocab_size", *EAGLE31_FLAGS):
                if getattr(bare, key) != getattr(cfg, key):
                    raise AssetError(f"config.json gives {key}={getattr(bare, key)!r} but the headstart record "
                                     f"says {getattr(cfg, key)!r} (edited after export?)")
        cfg.target = {}
        cfg = cfg.resolve(target)
        check_compatible(cfg, target, where=str(src / "config.json"))
        _check_declared_sizes(config, cfg, target, src)
        head = FAMILIES[cfg.head_type](cfg, target).to(device=target.model.embed_tokens.weight.device)
        fresh = layout.write(head, target)[1] if layout.refuse(head) is None else None
    except HeadstartError as e:
        raise AssetError(f"{src}: {e}") from None
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError) as e:
        raise AssetError(f"{src}: config.json or its tensors do not describe a {layout.name} checkpoint "
                         f"({type(e).__name__}: {str(e)[:160]})") from None
    if fresh is not None:  # the names as the layout spells them, tolerated extras and omissions
        want = {k: tuple(v.shape) for k, v in fresh.items() if k in tensors or k not in layout.optional}
        check_tensors(str(src), tensors, want | _optional(tensors, fresh))
    own = head.state_dict()
    check_tensors(str(src), state, {k: tuple(v.shape) for k, v in own.items()})
    for name, t in state.items():
        if own[name].is_floating_point() != t.is_floating_point() or (own[name].dtype == torch.bool) != (
                t.dtype == torch.bool):
            raise AssetError(f"{src}: {name} has dtype {t.dtype}, expected {own[name].dtype}")
    _check_vocab_maps(state, target, src)
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), target.dtype)
    head = head.to(dtype=dtype)
    head.load_state_dict({k: v.to(own[k].dtype if not own[k].is_floating_point() else dtype)
                          for k, v in state.items()}, strict=True)
    _check_finite({k: v for k, v in head.state_dict().items()}, f"{src} (in {dtype})")
    return head


def _check_target(config: dict[str, Any], target: LlamaForCausalLM, src: Path, allow_other: bool) -> None:
    """An export we wrote records its target: another target's (same shape, other weights) is refused."""
    meta = config.get("headstart")
    recorded = None
    if isinstance(meta, dict) and isinstance(meta.get("head_config"), dict):
        rec_target = meta["head_config"].get("target")
        recorded = rec_target.get("fingerprint") if isinstance(rec_target, dict) else None
    actual = target.fingerprint()
    if recorded and recorded != actual:
        msg = (f"{src}: exported from a head made for target {str(recorded)[:12]}…, this target is {actual[:12]}… "
               "(same shape, other weights)")
        if not allow_other:
            raise AssetError(msg + "; pass --allow-other-target to import it anyway")
        import warnings

        warnings.warn(msg, stacklevel=3)


def _check_declared_sizes(config: dict[str, Any], cfg: HeadConfig, target: LlamaForCausalLM, src: Path) -> None:
    """What a checkpoint's config.json states about the layer must agree with the head it gives and
    the target: a serving engine builds its draft model from these fields (at the same hidden size,
    twice the heads would keep every tensor shape and silently compute another attention)."""
    t = target.config
    want: dict[str, Any] = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                            "num_attention_heads": cfg.num_attention_heads,
                            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                            "target_hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
                            "rms_norm_eps": t.rms_norm_eps, "hidden_act": t.hidden_act}
    if getattr(t, "kv_lora_rank", None) is not None:
        # A DeepSeek config states the target's own MLA shape (its head_dim is the rope part, it has
        # no GQA): the MTP block is built from it, so those fields must be the target's.
        want.update(num_key_value_heads=None, head_dim=None, intermediate_size=t.intermediate_size,
                    kv_lora_rank=t.kv_lora_rank, qk_rope_head_dim=t.qk_rope_head_dim,
                    n_routed_experts=t.n_routed_experts)
    layer = config.get("transformer_layer_config")
    sources = [("", config)] + ([("transformer_layer_config.", layer)] if isinstance(layer, dict) else [])
    for prefix, section in sources:
        for key, expected in want.items():
            have = section.get(key)
            if have is None or expected is None:
                continue
            if isinstance(expected, str):
                ok = have == expected
            elif isinstance(expected, float):
                ok = isinstance(have, int | float) and not isinstance(have, bool) and float(have) == expected
            else:
                ok = isinstance(have, int) and not isinstance(have, bool) and have == expected
            if not ok:
                whose = "the target has" if key in ("target_hidden_size", "vocab_size", "rms_norm_eps",
                                                     "hidden_act") else "the head it holds has"
                raise AssetError(f"{src / 'config.json'}: {prefix}{key}={str(have)[:20]!s} but {whose} {expected}")


def _check_vocab_maps(state: dict[str, torch.Tensor], target: LlamaForCausalLM, src: Path) -> None:
    """d2t must map every draft id into the target vocabulary, and t2d mark exactly those tokens."""
    if "d2t" not in state:
        return
    vocab = target.config.vocab_size
    d2t = state["d2t"].long()
    ids = torch.arange(d2t.numel()) + d2t
    if d2t.numel() and (ids.min() < 0 or ids.max() >= vocab):
        raise AssetError(f"{src}: d2t maps draft ids outside the target vocabulary [0, {vocab})")
    if ids.unique().numel() != ids.numel():
        raise AssetError(f"{src}: d2t maps two draft ids to one target token")
    if "t2d" in state:
        t2d = state["t2d"].bool()
        if int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all()):
            raise AssetError(f"{src}: t2d does not mark the tokens d2t maps to ({int(t2d.sum())} marked, "
                             f"{d2t.numel()} draft ids)")


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
    bs = a.config.block_size or 0
    n = max(12, 2 * bs + 2)
    ids = torch.randint(0, t.vocab_size, (n,), generator=gen)
    device = a.target.model.model.embed_tokens.weight.device
    hidden = torch.randn(n, t.hidden_size, generator=gen).to(device, a.target.model.dtype)
    aux_ids = a.config.aux_layer_ids or []
    aux = torch.randn(n, len(aux_ids), t.hidden_size, generator=gen).to(device, a.target.model.dtype) \
        if aux_ids else None
    batch = PackedBatch(ids.to(device), [5, n - 5] if not bs else [n // 2, n - n // 2], hidden, aux, None)
    if a.config.head_type == "dflash":  # a block at the start of each sequence and one that reads a context
        from headstart.heads.dflash import AnchoredBlocks

        blocks = AnchoredBlocks(torch.tensor([0, 1, n // 2 + 1]), torch.tensor([0, 0, 1]), bs)
        with torch.no_grad():
            return torch.equal(a.compute_logits(a.train_blocks(batch, blocks)),
                               b.compute_logits(b.train_blocks(batch, blocks)))
    with torch.no_grad():  # the output states too: what the next draft step is fed (eagle3's norm_output)
        ha, _ = a.train_forward(batch)
        hb, _ = b.train_forward(batch)
        return torch.equal(ha, hb) and torch.equal(a.compute_logits(ha), b.compute_logits(hb))


__all__ = ["EXPORT_FORMATS", "IMPORT_FORMATS", "check_export_output", "export_head", "import_head", "is_export"]
