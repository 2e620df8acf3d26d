"""Weight loading from a safetensors directory (single file or sharded index) via a name-mapping table.

A model declares `packed`: HF name fragments that are row blocks of one of our fused parameters,
e.g. "q_proj" -> ("qkv_proj", 0) means HF's q_proj rows form block 0 of our qkv_proj. Every
parameter must be filled exactly; a missing tensor or a wrong shape is an error naming both.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from torch import nn

from headstart.errors import AssetError

Shard = Callable[[str, "int | None"], "tuple | str | None"]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
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
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                if any(s in hf_name for s in skip):
                    continue
                name, block = _map_name(hf_name, packed)
                if name not in params:
                    continue  # extra tensors (e.g. an MTP layer) are not ours to load
                param = params[name]
                if block is None:
                    target = param.data
                else:
                    _, idx, sizes = block
                    if -1 in sizes:  # equal blocks, sized by the parameter (its rows / the number of blocks)
                        sizes = [param.shape[0] // len(sizes)] * len(sizes)
                    start = sum(sizes[:idx])
                    target = param.data.narrow(0, start, sizes[idx])
                part = shard(name, None if block is None else block[1]) if shard is not None else None
                if part == "zero":
                    target.zero_()
                    filled[name] = filled.get(name, 0) + 1
                    continue
                tensor, target = _read(f, hf_name, part, target, path)
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


def _read(f, hf_name: str, part: tuple | None, target, path: Path):
    """The checkpoint tensor (or its part) and where it goes in the parameter."""
    if part is None:
        return f.get_tensor(hf_name), target
    dim, start, length, *pad = part
    sl = f.get_slice(hf_name)
    shape = sl.get_shape()
    if dim >= len(shape) or start + length > shape[dim]:
        raise AssetError(f"{path.name}: tensor {hf_name!r} has shape {tuple(shape)}, too small for rows "
                         f"{start}..{start + length} of dim {dim}; is config.json the right one?")
    index = tuple([slice(None)] * dim + [slice(start, start + length)])
    tensor = sl[index]
    if pad and length < target.shape[dim]:  # vocabulary padding of the last rank
        target.zero_()
        target = target.narrow(dim, 0, length)
    return tensor, target


def _map_name(hf_name: str, packed: dict[str, tuple[str, int, list[int]]]):
    for frag, spec in packed.items():
        key = f".{frag}."
        if key in hf_name:
            return hf_name.replace(key, f".{spec[0]}."), spec
    return hf_name, None
