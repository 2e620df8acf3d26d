"""Weight loading from a safetensors directory (single file or sharded index) via a name-mapping table.

A model declares `packed`: HF name fragments that are row blocks of one of our fused parameters,
e.g. "q_proj" -> ("qkv_proj", 0) means HF's q_proj rows form block 0 of our qkv_proj. Every
parameter must be filled exactly; a missing tensor or a wrong shape is an error naming both.

Block-scaled FP8 checkpoints (DeepSeek-V3/R1 as released) are dequantised as they are read: an FP8
`X.weight` (R, C) comes with `X.weight_scale_inv` (ceil(R/b0), ceil(C/b1)) for config.json's
`quantization_config.weight_block_size` [b0, b1], and the weight is each block times its scale. Any
other quantization is refused: its tensors are not weights a cast can read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import nullcontext
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from headstart.errors import AssetError

Shard = Callable[[str, "int | None"], "tuple | str | None"]
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names for float8_e4m3fn / float8_e5m2
SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv", DeepSeek's and HF FineGrainedFP8's name


def fp8_block_size(cfg: dict[str, Any], where: str) -> tuple[int, int] | None:
    """config.json's FP8 weight block (rows, columns), or None for an unquantised checkpoint. Any other
    quantization_config is refused by name (`where`: the config file), before anything is built."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise AssetError(f"{where}: quantization_config must be an object, got {str(q)[:40]!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise AssetError(f"{where}: quantization_config.quant_method {str(method)[:40]!r} is not supported "
                         "(only block-scaled 'fp8', as DeepSeek-V3 ships); dequantise the checkpoint first "
                         "(load it in transformers and save_pretrained it in bf16) or use the unquantised original")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise AssetError(f"{where}: quantization_config.weight_block_size must be two positive integers, got "
                         f"{str(block)[:40]}; only block-scaled FP8 is supported (per-tensor or per-channel "
                         "scales are not): dequantise the checkpoint first")
    if q.get("fmt", "e4m3") not in ("e4m3", "e5m2"):
        raise AssetError(f"{where}: quantization_config.fmt {str(q['fmt'])[:20]!r} is not an FP8 format "
                         "(e4m3 or e5m2); dequantise the checkpoint first")
    if q.get("activation_scheme", "dynamic") != "dynamic":  # as transformers' FineGrainedFP8Config
        raise AssetError(f"{where}: quantization_config.activation_scheme "
                         f"{str(q['activation_scheme'])[:20]!r} is not supported with block-scaled FP8 (only "
                         "'dynamic'); dequantise the checkpoint first")
    return block[0], block[1]


def check_sizes(cfg: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...], where: str) -> None:
    """A model config's sizes are positive integers (a damaged or hand-edited config.json names its
    key here, not as a TypeError or ZeroDivisionError deep in the model's construction)."""
    for key in required + optional:
        if key not in cfg or (key in optional and cfg[key] is None):
            if key in required:
                raise AssetError(f"{where}: missing key {key!r}")
            continue
        value = cfg[key]
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise AssetError(f"{where}: {key} = {str(value)[:40]!r} is not a size: it must be a positive integer "
                             "(the config.json is damaged or was edited; restore it from the model's checkpoint)")


def empty_weight_map(index: Path) -> str:
    """The message for a safetensors index that names no weights file (whatever lies beside it)."""
    beside = sorted(p.name for p in index.parent.glob("*.safetensors"))
    there = f" although {', '.join(beside[:3])} lies beside it" if beside else ""
    return (f"{index}: its weight_map is empty, so it names no weights file{there}; restore the index from the "
            "original checkpoint, or delete it to read the *.safetensors files directly")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if not names:
            raise AssetError(empty_weight_map(index))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise AssetError(f"{index}: lists shards that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise AssetError(f"{model_dir}: no *.safetensors weights found")
    return files


def load_weights(
    model: nn.Module, model_dir: Path, packed: dict[str, tuple[str, int, list[int]]],
    skip: tuple[str, ...] = (), tied: dict[str, str] | None = None, shard: Shard | None = None,
) -> None:
    """Copy tensors into `model`'s parameters.

    packed: HF fragment -> (our fragment, block index, block sizes along dim 0; all -1: equal blocks).
    skip: HF name substrings to ignore (e.g. rotary caches some checkpoints carry).
    tied: our param -> our param it shares storage with (filled from the other if absent).
    shard: (our param, block or None) -> the part of the checkpoint tensor it holds, (dim, start,
        length[, "pad"]), or None for all of it, or "zero" (filled with zeros); only that part is
        read from the file (a tensor-parallel rank never reads the whole model). A "pad" part may be
        shorter than the parameter (the last rank's vocabulary rows): it fills its head and the rest
        is zeroed; any other length mismatch is an error.
    """
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}  # our name -> number of blocks written
    needed = {name: 1 for name in params}
    for ours, _, sizes in packed.values():
        for name in params:
            if f".{ours}." in f".{name}":
                needed[name] = len(sizes)
    for name, p in params.items():
        if STACKED_EXPERTS.search(name):  # one checkpoint tensor (or its blocks) per expert
            needed[name] *= p.shape[0]
    files = safetensors_files(model_dir)
    fp8 = _Fp8(model_dir, files)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith(SCALE_SUFFIX) or any(s in hf_name for s in skip):
                    continue  # a scale is read with its weight
                name, block = _map_name(hf_name, packed)
                name, expert = _stacked_name(name, params)
                if name not in params:
                    continue  # extra tensors (e.g. an MTP layer) are not ours to load
                param = params[name]
                if expert is not None and not 0 <= expert < param.shape[0]:
                    raise AssetError(f"{path.name}: tensor {hf_name!r} names expert {expert}; the model has "
                                     f"{param.shape[0]} (n_routed_experts); is config.json the right one?")
                whole = param.data if expert is None else param.data[expert]
                if block is None:
                    target = whole
                else:
                    _, idx, sizes = block
                    if -1 in sizes:  # equal blocks, sized by the parameter (its rows / the number of blocks)
                        sizes = [whole.shape[0] // len(sizes)] * len(sizes)
                    start = sum(sizes[:idx])
                    target = whole.narrow(0, start, sizes[idx])
                part = shard(name, None if block is None else block[1]) if shard is not None else None
                if part == "zero":
                    target.zero_()
                    filled[name] = filled.get(name, 0) + 1
                    continue
                tensor, target = _read(f, hf_name, part, target, path, fp8)
                if tuple(target.shape) != tuple(tensor.shape):
                    raise AssetError(
                        f"{path.name}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(target.shape)} (for {name}); is config.json the right one?"
                    )
                target.copy_(tensor.to(target.dtype))
                filled[name] = filled.get(name, 0) + 1
    for ours, source in (tied or {}).items():
        if ours in params and filled.get(ours, 0) == 0 and filled.get(source, 0):
            filled[ours] = needed[ours]
    missing = sorted(n for n in params if filled.get(n, 0) < needed[n])
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise AssetError(f"{model_dir}: the weights lack tensors for: {shown}")


def _read(f, hf_name: str, part: tuple | None, target, path: Path, fp8: _Fp8):
    """The checkpoint tensor (or its part, dequantised if FP8) and where it goes in the parameter."""
    sl = f.get_slice(hf_name)
    kind = sl.get_dtype()
    quantised = kind in FP8_DTYPES
    if kind.startswith("F8_") and not quantised:  # e4m3fnuz / e5m2fnuz / e8m0: other scale semantics
        raise AssetError(f"{path.name}: tensor {hf_name!r} is {kind}, an FP8 format this loader does not read "
                         f"(it reads {' and '.join(FP8_DTYPES)} with block scales); dequantise the checkpoint first")
    if part is None:
        if quantised:
            return fp8.dequantised(f, path, hf_name), target
        return f.get_tensor(hf_name), target
    dim, start, length, *pad = part
    shape = sl.get_shape()
    if dim >= len(shape) or start + length > shape[dim]:
        raise AssetError(f"{path.name}: tensor {hf_name!r} has shape {tuple(shape)}, too small for rows "
                         f"{start}..{start + length} of dim {dim}; is config.json the right one?")
    if quantised:
        tensor = fp8.dequantised(f, path, hf_name, dim, start, length)
    else:
        tensor = sl[tuple([slice(None)] * dim + [slice(start, start + length)])]
    if pad and length < target.shape[dim]:  # vocabulary padding of the last rank
        target.zero_()
        target = target.narrow(dim, 0, length)
    return tensor, target


class _Fp8:
    """Dequantises a checkpoint's block-scaled FP8 tensors with their scales, which may be in another file."""

    def __init__(self, model_dir: Path, files: list[Path]) -> None:
        self.config = model_dir / "config.json"
        self.model_dir, self.files = model_dir, files

    @cached_property
    def block(self) -> tuple[int, int]:
        cfg = json.loads(self.config.read_text()) if self.config.is_file() else {}
        block = fp8_block_size(cfg, str(self.config))
        if block is None:
            raise AssetError(f"{self.config}: the weights are FP8 but there is no quantization_config giving "
                             "their weight_block_size; add it (DeepSeek-V3's is [128, 128]) or dequantise first")
        return block

    @cached_property
    def format(self) -> torch.dtype:
        return fp8_format(json.loads(self.config.read_text()) if self.config.is_file() else {})

    @cached_property
    def where(self) -> dict[str, Path]:
        """Tensor name -> the file holding it (the index's weight_map, or every file's header)."""
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            return {k: self.model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        where: dict[str, Path] = {}
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                where.update(dict.fromkeys(f.keys(), path))
        return where

    def dequantised(self, f, path: Path, name: str, dim: int = 0, start: int = 0,
                    length: int | None = None) -> torch.Tensor:
        """Rows start..start+length (None: all) along `dim` of FP8 tensor `name` (open as `f`, in `path`),
        in fp32. Only the blocks that hold them are read and scaled."""
        shape = tuple(f.get_slice(name).get_shape())
        if len(shape) != 2:
            raise AssetError(f"{path.name}: FP8 tensor {name!r} has shape {shape}; only 2-D block-scaled "
                             "weights are supported: dequantise the checkpoint first")
        scale_name = name + SCALE_SUFFIX
        scale_path = self.where.get(scale_name)
        if scale_path is None:
            raise AssetError(f"{path.name}: tensor {name!r} is FP8 but the checkpoint has no {scale_name!r}; "
                             "cast without its block scales it would be silently wrong. Add the scales or "
                             "dequantise the checkpoint first")
        b = self.block
        length = shape[dim] if length is None else length
        blocks = (-(-shape[0] // b[0]), -(-shape[1] // b[1]))
        lo, hi = start // b[dim] * b[dim], min(-(-(start + length) // b[dim]) * b[dim], shape[dim])
        lead = [slice(None)] * dim
        weight = f.get_slice(name)[tuple(lead + [slice(lo, hi)])]
        with nullcontext(f) if scale_path == path else safe_open(str(scale_path), framework="pt") as g:
            sl = g.get_slice(scale_name)
            if tuple(sl.get_shape()) != blocks:
                raise AssetError(f"{scale_path.name}: {scale_name!r} has shape {tuple(sl.get_shape())}, but "
                                 f"{name!r} {shape} in blocks of {list(b)} needs {blocks}; is "
                                 f"{self.config.name}'s weight_block_size the right one?")
            scale = sl[tuple(lead + [slice(lo // b[dim], -(-hi // b[dim]))])]
        check_fp8_tensor(name, weight, scale, self.format, path.name, b)  # the slice starts on a block edge
        return dequantise_fp8(weight, scale, b).narrow(dim, start - lo, length)


FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_format(cfg: dict[str, Any]) -> torch.dtype:
    """The FP8 dtype config.json's quantization_config.fmt names (default e4m3, as DeepSeek ships)."""
    return FP8_FORMATS[(cfg.get("quantization_config") or {}).get("fmt", "e4m3")]


def check_fp8_tensor(name: str, weight: torch.Tensor, scale_inv: torch.Tensor, expected: torch.dtype,
                     where: str, block: tuple[int, int] | None = None) -> None:
    """An FP8 weight in the format config.json declares, with finite positive floating-point block scales
    (zero only over a block of zeros): anything else dequantises to garbage (NaN scales decode empty text)
    without an error. `block`: the weight's block size (None: a zero scale is refused outright)."""
    if weight.dtype != expected:
        raise AssetError(f"{where}: {name!r} is {weight.dtype} but quantization_config.fmt declares {expected}; "
                         "the bytes would be read in the wrong format: fix fmt or dequantise the checkpoint first")
    if not scale_inv.is_floating_point() or scale_inv.dtype in FP8_FORMATS.values():
        raise AssetError(f"{where}: {name + SCALE_SUFFIX!r} has dtype {scale_inv.dtype}; block scales are fp32 "
                         "(or bf16 / fp16)")
    s = scale_inv.float()
    bad = ~(torch.isfinite(s) & (s >= 0))
    if block is not None and weight.ndim == 2 and bool((s == 0).any()):  # a zero scale: only over zero weights
        b0, b1 = block
        rows, cols = weight.shape
        nz = torch.zeros(s.shape[0] * b0, s.shape[1] * b1, dtype=torch.bool)
        nz[:rows, :cols] = weight.float() != 0
        bad |= (s == 0) & nz.view(s.shape[0], b0, s.shape[1], b1).any(3).any(1)
    elif block is None:
        bad |= s == 0
    if bool(bad.any()):
        value = scale_inv.float()[bad][0].item()
        raise AssetError(f"{where}: {name + SCALE_SUFFIX!r} holds {int(bad.sum())} block scale(s) that are not "
                         f"finite and positive (e.g. {value}); the checkpoint is damaged: restore it from the original")


def dequantise_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight (R, C) in FP8 times the scale of its block, scale_inv (ceil(R/b0), ceil(C/b1)), in fp32.
    The last block of a row or column may be partial, as in DeepSeek's own weight_dequant."""
    r, c = weight.shape
    b0, b1 = block
    out = weight.float()
    per_col = scale_inv.float().repeat_interleave(b1, dim=1)[:, :c]  # (ceil(R/b0), C)
    full = r // b0
    out[: full * b0].view(full, b0, c).mul_(per_col[:full, None])  # (full, b0, C) * (full, 1, C)
    if r % b0:
        out[full * b0:].mul_(per_col[full])  # the partial last row block
    return out


# Routed experts stacked into one parameter (headstart.nn.experts): "...experts.gate_up_proj.weight" (E, ...)
# is filled by the checkpoint's "...experts.{e}.gate_proj.weight" / "up_proj" (blocks) / "down_proj". Export
# writes it back one tensor per expert, "...experts.{e}.gate_up_proj.weight" (ONE_EXPERT; headstart.export.layout).
_STACKED_PROJECTIONS = r"(gate_up_proj|down_proj)"
STACKED_EXPERTS = re.compile(rf"\.experts\.{_STACKED_PROJECTIONS}\.weight$")
ONE_EXPERT = re.compile(rf"\.experts\.(\d+)\.{_STACKED_PROJECTIONS}\.weight$")
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _stacked_name(name: str, params: dict[str, Any]) -> tuple[str, int | None]:
    """(our stacked parameter, expert index) for a per-expert checkpoint name, else (name, None)."""
    m = _PER_EXPERT.search(name)
    if m is None or name in params:
        return name, None
    stacked = name[:m.start()] + ".experts." + name[m.end():]
    return (stacked, int(m.group(1))) if stacked in params else (name, None)


def _map_name(hf_name: str, packed: dict[str, tuple[str, int, list[int]]]):
    for frag, spec in packed.items():
        key = f".{frag}."
        if key in hf_name:
            return hf_name.replace(key, f".{spec[0]}."), spec
    return hf_name, None
