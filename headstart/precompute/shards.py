"""Hidden-state shards (docs/architecture.md): format, writing (atomic), reading (checked), fp8 storage.

A shard is one safetensors file of packed sequences:
    input_ids    int32 (N,)        loss_mask uint8 (N,)        seq_offsets int64 (S+1,)
    hidden       bf16 (N, d)  or fp8 e4m3 (N, d) + hidden_scale fp32 (N,)
    aux_hidden   bf16 (N, A, d) or fp8 e4m3 (N, A, d) + aux_scale fp32 (N, A)       (optional)
Its header metadata repeats what the manifest records about it (index, sequences, tokens, fp8
error), so a shard that reached its final name describes itself: a crash after the rename and
before the manifest update loses nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from headstart.errors import DataError
from headstart.fileio import apply_umask, sha256_file

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., d) -> (e4m3 values, fp32 per-row scale (...)) with x ≈ values * scale."""
    x = x.float()
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    return (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def from_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale.unsqueeze(-1)


@dataclass
class ShardRecord:
    name: str
    index: int
    sequences: int
    tokens: int
    bytes: int
    sha256: str
    fp8_rel_error: float | None = None  # ||x - dequant(quant(x))|| / ||x|| over the shard


def write_shard(path: Path, index: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, seq_lens: list[int],
                hidden: torch.Tensor, aux: torch.Tensor | None, storage: str) -> ShardRecord:
    """Write one shard under a temporary name, fsync, and rename it into place."""
    n = int(input_ids.numel())
    if hidden.shape[0] != n or loss_mask.numel() != n or sum(seq_lens) != n:
        raise ValueError(f"shard {index}: inconsistent sizes (ids {n}, hidden {hidden.shape[0]}, "
                         f"mask {loss_mask.numel()}, sequences {sum(seq_lens)})")
    offsets = torch.tensor([0] + list(seq_lens), dtype=torch.int64).cumsum(0)
    tensors: dict[str, torch.Tensor] = {
        "input_ids": input_ids.to(torch.int32).contiguous(),
        "loss_mask": loss_mask.to(torch.uint8).contiguous(),
        "seq_offsets": offsets,
    }
    err = None
    if storage == "fp8":
        q, s = to_fp8(hidden)
        tensors["hidden"], tensors["hidden_scale"] = q.contiguous(), s.contiguous()
        ref = hidden.float()
        err = float((from_fp8(q, s) - ref).norm() / ref.norm().clamp(min=1e-12))
        if aux is not None:
            qa, sa = to_fp8(aux)
            tensors["aux_hidden"], tensors["aux_scale"] = qa.contiguous(), sa.contiguous()
    elif storage == "bf16":
        tensors["hidden"] = hidden.to(torch.bfloat16).contiguous()
        if aux is not None:
            tensors["aux_hidden"] = aux.to(torch.bfloat16).contiguous()
    else:
        raise ValueError(f"unknown storage {storage!r}; choose bf16 or fp8")
    # One metadata key holding sorted JSON: safetensors writes its metadata map in arbitrary key
    # order, and shards must be byte-identical however and whenever they were computed.
    meta = {"headstart": json.dumps({"index": index, "sequences": len(seq_lens), "tokens": n, "storage": storage,
                                     "fp8_rel_error": err}, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        apply_umask(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:  # a full disk reaches us as a SafetensorError
        reason = getattr(e, "strerror", None) or str(e)[:160]
        raise DataError(f"{path}: could not write the shard ({reason}); nothing was kept") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return ShardRecord(path.name, index, len(seq_lens), n, path.stat().st_size, sha256_file(path), err)


def read_record(path: Path) -> ShardRecord:
    """The record of a complete shard, from its own header (used when resuming)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise DataError(f"{path}: not a readable shard ({e})") from None
    if "headstart" not in meta:
        raise DataError(f"{path}: not a headstart shard (no header metadata)")
    info = json.loads(meta["headstart"])
    return ShardRecord(path.name, info["index"], info["sequences"], info["tokens"], path.stat().st_size,
                       sha256_file(path), info["fp8_rel_error"])


@dataclass
class ShardData:
    input_ids: torch.Tensor  # (N,) long
    loss_mask: torch.Tensor  # (N,) uint8
    seq_lens: list[int]
    hidden: torch.Tensor  # (N, d) float (dequantised when stored as fp8)
    aux_hidden: torch.Tensor | None  # (N, A, d)


def load_shard(path: Path, record: dict[str, Any] | None = None, checksum: bool = False) -> ShardData:
    """Load a shard, checking it against its manifest record (size always, sha256 on request)."""
    if not path.is_file():
        raise DataError(f"{path}: shard listed in the manifest is missing")
    if record is not None:
        size = path.stat().st_size
        if size != record["bytes"]:
            raise DataError(f"{path}: {size} bytes on disk, the manifest says {record['bytes']} (truncated or "
                            "replaced); rerun precompute with --resume after deleting it")
        if checksum and sha256_file(path) != record["sha256"]:
            raise DataError(f"{path}: sha256 differs from the manifest (corrupted)")
    try:
        with safe_open(str(path), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise DataError(f"{path}: unreadable shard ({e})") from None
    for key in ("input_ids", "loss_mask", "seq_offsets", "hidden"):
        if key not in t:
            raise DataError(f"{path}: missing tensor {key!r}")
    n = t["input_ids"].numel()
    offsets = t["seq_offsets"]
    if t["hidden"].shape[0] != n or t["loss_mask"].numel() != n or int(offsets[-1]) != n:
        raise DataError(f"{path}: tensor sizes disagree (ids {n}, hidden {tuple(t['hidden'].shape)}, "
                        f"offsets end {int(offsets[-1])})")
    hidden = from_fp8(t["hidden"], t["hidden_scale"]) if "hidden_scale" in t else t["hidden"]
    aux = t.get("aux_hidden")
    if aux is not None and "aux_scale" in t:
        aux = from_fp8(aux, t["aux_scale"])
    return ShardData(t["input_ids"].long(), t["loss_mask"], torch.diff(offsets).tolist(), hidden, aux)


def write_json_atomic(path: Path, obj: Any) -> None:
    from headstart.fileio import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2))
