"""Reading a precompute directory: verify it against its manifest, summarise it, iterate its shards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from headstart.errors import DataError
from headstart.fileio import read_json_object
from headstart.precompute.run import FORMAT
from headstart.precompute.shards import ShardData, load_shard


def read_manifest(directory: str | Path) -> dict[str, Any]:
    d = Path(directory)
    f = d / "manifest.json"
    if not f.is_file():
        unfinished = (d / "run.json").exists()
        hint = " (run.json exists: the run is unfinished; rerun precompute with --resume)" if unfinished else ""
        raise DataError(f"{d}: no manifest.json{hint}")
    manifest = read_json_object(f, "manifest")
    if manifest.get("format") != FORMAT:
        raise DataError(f"{f}: unknown format {manifest.get('format')!r} (expected {FORMAT!r})")
    listed = {s["name"] for s in manifest["shards"]}
    on_disk = {p.name for p in d.glob("shard-*.safetensors")}
    if listed != on_disk:
        missing, extra = sorted(listed - on_disk), sorted(on_disk - listed)
        raise DataError(f"{f}: the shard list disagrees with the files (missing: {missing or 'none'}; "
                        f"not in the manifest: {extra or 'none'})")
    return manifest


def verify(directory: str | Path, checksums: bool = True) -> dict[str, Any]:
    """Check every shard (presence, size, sha256, tensor shapes, counts) against the manifest."""
    d = Path(directory)
    manifest = read_manifest(d)
    d_model = manifest["target"]["hidden_size"]
    n_aux = len(manifest["captured"]["aux_layers"])
    for rec in manifest["shards"]:
        data = load_shard(d / rec["name"], rec, checksum=checksums)
        if len(data.seq_lens) != rec["sequences"] or data.input_ids.numel() != rec["tokens"]:
            raise DataError(f"{d / rec['name']}: holds {len(data.seq_lens)} sequences / {data.input_ids.numel()} "
                            f"tokens, the manifest says {rec['sequences']} / {rec['tokens']}")
        if data.hidden.shape[1] != d_model:
            raise DataError(f"{d / rec['name']}: hidden width {data.hidden.shape[1]}, the target's is {d_model}")
        if n_aux and (data.aux_hidden is None or data.aux_hidden.shape[1] != n_aux):
            raise DataError(f"{d / rec['name']}: expected {n_aux} aux layers")
    return manifest


def summary(manifest: dict[str, Any]) -> dict[str, Any]:
    return {
        "sequences": manifest["sequences"],
        "tokens": manifest["tokens"],
        "bytes_per_token": round(manifest["bytes_per_token"], 3),
        "dtype": manifest["storage"],
        "shards": len(manifest["shards"]),
        "bytes": manifest["bytes"],
        "fp8_rel_error": manifest.get("fp8_rel_error"),
        "hidden_size": manifest["target"]["hidden_size"],
        "aux_layers": manifest["captured"]["aux_layers"],
        "fingerprints": manifest["fingerprints"],
    }


def iter_shards(directory: str | Path, checksums: bool = False) -> Iterator[ShardData]:
    """Shards in order, each checked against the manifest (a damaged one is refused, by name)."""
    d = Path(directory)
    manifest = read_manifest(d)
    for rec in manifest["shards"]:
        yield load_shard(d / rec["name"], rec, checksum=checksums)
