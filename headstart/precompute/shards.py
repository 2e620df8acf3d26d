"""Hidden-state shards (docs/architecture.md): format, writing (atomic), reading (checked), fp8 storage.

A shard is one safetensors file of packed sequences:
    input_ids    int32 (N,)        loss_mask uint8 (N,)        seq_offsets int64 (S+1,)
    hidden       bf16 (N, d)  or fp8 e4m3 (N, d) + hidden_scale fp32 (N,)
    aux_hidden   bf16 (N, A, d) or fp8 e4m3 (N, A, d) + aux_scale fp32 (N, A)       (optional)
Its header metadata repeats what the manifest records about it (index, sequences, tokens, fp8
error), so a shard that reached its final name describes itself: a crash after the rename and
before the manifest update loses nothing.

`ShardWriter` writes a shard as its forward batches arrive: every shape is known before the first
forward, so the file is laid out at the start and each batch's rows go straight to their place (fp8
quantised where the batch was computed). A rank holds one batch, not one shard: a whole 4M-token
shard of a 1B target in memory was 51.8 GB of host RAM on an H200 (100 KB per token: the bf16 states,
their concatenation and fp32 copies for the quantisation), against 0.53 GB in `headstart plan`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from headstart.errors import DataError
from headstart.fileio import apply_umask, sha256_file
from headstart.sizing import QUANT_ROWS  # fp32 copies of QUANT_ROWS x (1 + A) x d, wherever the states are

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


# safetensors' names of the dtypes a shard holds
ST_DTYPES = {torch.int64: "I64", torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16",
             torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}


class ShardWriter:
    """`w = ShardWriter(path, index, input_ids, loss_mask, seq_lens, d, aux_layers, storage)`, then
    `w.add(hidden, aux)` per forward batch in token order (on any device), then `w.close()` -> record.

    The file is a plain safetensors file: an 8-byte header length, a JSON header (space-padded to a
    length fixed at the start, so the fp8 error known only at the end fits), then the tensors back to
    back, widest elements first (aligned). It is written under a temporary name, fsynced and renamed;
    `abort()` (or an exception inside `with`) removes it. Deterministic: the same batches write the
    same bytes."""

    def __init__(self, path: Path, index: int, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 seq_lens: list[int], d: int, aux_layers: int, storage: str) -> None:
        if storage not in ("fp8", "bf16"):
            raise ValueError(f"unknown storage {storage!r}; choose bf16 or fp8")
        n = int(input_ids.numel())
        if loss_mask.numel() != n or sum(seq_lens) != n:
            raise ValueError(f"shard {index}: inconsistent sizes (ids {n}, mask {loss_mask.numel()}, "
                             f"sequences {sum(seq_lens)})")
        self.path, self.index, self.n, self.storage = path, index, n, storage
        self.sequences, self.d, self.aux_layers = len(seq_lens), d, aux_layers
        fixed = {"input_ids": input_ids.to(torch.int32).contiguous(),
                 "loss_mask": loss_mask.to(torch.uint8).contiguous(),
                 "seq_offsets": torch.tensor([0] + list(seq_lens), dtype=torch.int64).cumsum(0)}
        state = torch.float8_e4m3fn if storage == "fp8" else torch.bfloat16
        rows = {"hidden": (state, (d,))}  # tensors filled row by row: (dtype, shape of one row)
        if storage == "fp8":
            rows["hidden_scale"] = (torch.float32, ())
        if aux_layers:
            rows["aux_hidden"] = (state, (aux_layers, d))
            if storage == "fp8":
                rows["aux_scale"] = (torch.float32, (aux_layers,))
        shapes = {k: (v.dtype, tuple(v.shape)) for k, v in fixed.items()}
        shapes.update({k: (dt, (n, *row)) for k, (dt, row) in rows.items()})
        order = sorted(shapes, key=lambda k: (-shapes[k][0].itemsize, k))  # widest first: every offset aligned
        self._offsets, at = {}, 0
        for k in order:
            dt, shape = shapes[k]
            size = math.prod(shape) * dt.itemsize
            self._offsets[k] = (at, at + size)
            at += size
        self._shapes = shapes
        self._data_bytes = at
        # room for the header with the largest fp8 error text, rounded up to 8 bytes
        self._header_len = -(-len(self._header(-1.2345678901234567e-300)) // 8) * 8
        self._data_start = 8 + self._header_len
        self._row_at = 0
        self._sq_err = self._sq_ref = 0.0
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            self._f = open(self.tmp, "wb")
            self._f.truncate(self._data_start + self._data_bytes)
            for k, t in fixed.items():
                self._put(k, 0, t)
        except OSError as e:
            self.abort()
            raise self._error(e) from None

    def _header(self, err: float | None) -> bytes:
        meta = json.dumps({"index": self.index, "sequences": self.sequences, "tokens": self.n, "storage": self.storage,
                           "fp8_rel_error": err}, sort_keys=True)
        head = {k: {"dtype": ST_DTYPES[dt], "shape": list(shape), "data_offsets": list(self._offsets[k])}
                for k, (dt, shape) in self._shapes.items()}
        # one metadata key holding sorted JSON: shards must be byte-identical however they were computed
        head["__metadata__"] = {"headstart": meta}
        return json.dumps(head, sort_keys=True, separators=(",", ":")).encode()

    def _put(self, key: str, row: int, t: torch.Tensor) -> None:
        """t's bytes at row `row` of tensor `key`."""
        dt, shape = self._shapes[key]
        row_bytes = math.prod(shape[1:]) * dt.itemsize
        self._f.seek(self._data_start + self._offsets[key][0] + row * row_bytes)
        self._f.write(t.to(dt).contiguous().cpu().view(torch.uint8).numpy().data)

    def add(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        """The next rows: hidden (m, d), aux (m, A, d) or None; quantised where they are."""
        m = hidden.shape[0]
        fits = hidden.dim() == 2 and hidden.shape[1] == self.d and self._row_at + m <= self.n
        if not fits or (aux is None) != (not self.aux_layers) or (
                aux is not None and aux.shape != (m, self.aux_layers, self.d)):
            self.abort()
            raise ValueError(f"shard {self.index}: a batch of {tuple(hidden.shape)} hidden states"
                             f"{'' if aux is None else f' and {tuple(aux.shape)} aux states'} does not fit rows "
                             f"{self._row_at}.. of {self.n} x {self.d} with {self.aux_layers} aux layers")
        try:
            for lo in range(0, m, QUANT_ROWS):  # the fp32 copies quantisation makes stay small, on any device
                self._add_rows(hidden[lo:lo + QUANT_ROWS], None if aux is None else aux[lo:lo + QUANT_ROWS])
        except OSError as e:
            self.abort()
            raise self._error(e) from None

    def _add_rows(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        if self.storage == "fp8":
            q, scale = to_fp8(hidden)
            ref = hidden.float()
            self._sq_err += float(torch.linalg.vector_norm(from_fp8(q, scale) - ref)) ** 2
            self._sq_ref += float(torch.linalg.vector_norm(ref)) ** 2
            self._put("hidden", self._row_at, q)
            self._put("hidden_scale", self._row_at, scale)
            if aux is not None:
                qa, sa = to_fp8(aux)
                self._put("aux_hidden", self._row_at, qa)
                self._put("aux_scale", self._row_at, sa)
        else:
            self._put("hidden", self._row_at, hidden)
            if aux is not None:
                self._put("aux_hidden", self._row_at, aux)
        self._row_at += hidden.shape[0]

    def close(self) -> ShardRecord:
        """Header, fsync, rename into place; the shard's record."""
        if self._row_at != self.n:
            self.abort()
            raise ValueError(f"shard {self.index}: {self._row_at} of {self.n} rows written")
        err = None
        if self.storage == "fp8":
            err = math.sqrt(self._sq_err) / max(math.sqrt(self._sq_ref), 1e-12)
        head = self._header(err)
        try:
            self._f.seek(0)
            self._f.write(struct.pack("<Q", self._header_len) + head + b" " * (self._header_len - len(head)))
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            apply_umask(self.tmp)
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise self._error(e) from None
        return ShardRecord(self.path.name, self.index, self.sequences, self.n, self.path.stat().st_size,
                           sha256_file(self.path), err)

    def abort(self) -> None:
        """Nothing kept: the temporary file is removed."""
        f = getattr(self, "_f", None)
        if f is not None and not f.closed:
            f.close()
        self.tmp.unlink(missing_ok=True)

    def _error(self, e: OSError) -> DataError:
        return DataError(f"{self.path}: could not write the shard ({e.strerror or e}); nothing was kept")

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is not None:
            self.abort()


def write_shard(path: Path, index: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, seq_lens: list[int],
                hidden: torch.Tensor, aux: torch.Tensor | None, storage: str) -> ShardRecord:
    """A whole shard at once (ShardWriter with one batch)."""
    n = int(input_ids.numel())
    if hidden.shape[0] != n or loss_mask.numel() != n or sum(seq_lens) != n:
        raise ValueError(f"shard {index}: inconsistent sizes (ids {n}, hidden {hidden.shape[0]}, "
                         f"mask {loss_mask.numel()}, sequences {sum(seq_lens)})")
    with ShardWriter(path, index, input_ids, loss_mask, seq_lens, hidden.shape[-1],
                     0 if aux is None else aux.shape[1], storage) as w:
        w.add(hidden, aux)
        return w.close()


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
