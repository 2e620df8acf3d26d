"""The native head checkpoint (docs/architecture.md): `config.json` + `model.safetensors` with the
trainable weights only, written atomically, its integrity records (the weights' sha256, the target's
fingerprint, the config the weights were saved with) checked before anything is built from it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from headstart.errors import AssetError
from headstart.fileio import apply_umask, atomic_path, check_output_path, read_json_object, sha256_file
from headstart.heads.base import DraftHead
from headstart.heads.config import EAGLE31_FLAGS, HIDDEN_STATE_CONVENTION, HeadConfig, saved_without


def save_head(head: DraftHead, path: str | Path, *, overwrite: bool = False) -> Path:
    """`config.json` + `model.safetensors` (trainable weights and maps only), written atomically.

    An existing directory is replaced only when it is a head checkpoint and `overwrite` is set."""
    cfg = dataclasses.asdict(head.config)
    cfg["hidden_state_convention"] = HIDDEN_STATE_CONVENTION
    cfg["format"] = "headstart-head/1"
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    # The config also travels inside the weights file: an edit of config.json (aux ids, a deleted
    # fingerprint) is then found on load instead of silently changing what the head reads.
    record = {CONFIG_RECORD: json.dumps(dataclasses.asdict(head.config), sort_keys=True)}
    with atomic_path(Path(path), **_head_output_rules(path, overwrite)) as tmp:
        path = Path(path).resolve()
        try:
            tmp.mkdir()
            save_file(state, str(tmp / "model.safetensors"), metadata=record)
        except (OSError, SafetensorError) as e:  # a full disk reaches us as a SafetensorError
            raise AssetError(f"{path}: the head cannot be written ({getattr(e, 'strerror', None) or str(e)[:160]}); "
                             "nothing was kept") from None
        apply_umask(tmp / "model.safetensors")
        cfg["weights_sha256"] = sha256_file(tmp / "model.safetensors")  # checked on load
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def check_head_output(path: str | Path, *, overwrite: bool = False) -> Path:
    """Refuse a head output path before any work is done (the rules of `save_head`)."""
    return check_output_path(path, **_head_output_rules(path, overwrite))


NATIVE_MARK = "EXPORTED_BY_HEADSTART"  # a native export is a head checkpoint plus this file
# What a head checkpoint directory holds (training's head-best adds its validation's metrics.json); it is
# replaced only when it holds nothing else.
HEAD_FILES = ("config.json", "model.safetensors", NATIVE_MARK, "metrics.json")


def _foreign_files(path: str | Path) -> list[str]:
    d = Path(path)
    return sorted(p.name for p in d.iterdir() if p.name not in HEAD_FILES) if d.is_dir() else []


def _head_output_rules(path: str | Path, overwrite: bool) -> dict:
    foreign = _foreign_files(path) if is_head_checkpoint(path) else []
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else "")
        hint = (f"it is a head checkpoint, but it also holds {listed}, which headstart did not write; replacing "
                "it would delete them: move them out, or choose a new path")
    else:
        hint = "it is a head checkpoint: pass --force to replace it" if is_head_checkpoint(path) else ""
    return {"replaces": _replaceable_head if overwrite else None, "hint": hint}


def _replaceable_head(path: Path) -> bool:
    """A head checkpoint holding only what `save_head` (and a native export) wrote."""
    return is_head_checkpoint(path) and not _foreign_files(path)


def is_head_checkpoint(path: str | Path) -> bool:
    """True for a native head checkpoint directory (as opposed to an HF model directory)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("format") == "headstart-head/1"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def read_head_config(path: str | Path) -> HeadConfig:
    return _read_head_config(path)[0]


CONFIG_RECORD = "headstart_head_config"  # model.safetensors metadata key: the config the weights were saved with


def _read_head_config(path: str | Path) -> tuple[HeadConfig, str]:
    """(config, recorded sha256 of model.safetensors). Both integrity records must be present: a
    config.json without them would silently switch off the checks they make."""
    path = Path(path)
    f = path / "config.json"
    if not f.is_file():
        raise AssetError(f"{path}: not a head checkpoint (no config.json)")
    raw = read_json_object(f, "head checkpoint's config")
    sha = raw.pop("weights_sha256", None)
    if not (isinstance(sha, str) and len(sha) == 64):
        raise AssetError(f"{f}: no valid weights_sha256 (it is written with every head; without it the weights "
                         "cannot be checked). Re-save the head, or re-import it from an export")
    raw.pop("hidden_state_convention", None)
    fmt = raw.pop("format", None)
    if fmt != "headstart-head/1":
        raise AssetError(f"{f}: unknown head checkpoint format {fmt!r} (expected 'headstart-head/1')")
    known = {f.name for f in dataclasses.fields(HeadConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise AssetError(f"{f}: unknown keys {[k[:40] for k in unknown[:8]]}")
    try:
        cfg = HeadConfig.from_record(raw)
    except (TypeError, ValueError) as e:
        raise AssetError(f"{f}: {str(e)[:200]}") from None
    fp = cfg.target.get("fingerprint") if isinstance(cfg.target, dict) else None
    if not (isinstance(fp, str) and fp):
        raise AssetError(f"{f}: no target.fingerprint (it records which target the head was trained for and is "
                         "written with every head). Re-save the head, or re-import it from an export")
    return cfg, sha


# HeadConfig fields added after heads were saved (the shipped one among them), with the value every
# earlier head had: a record without one was saved with that value.
LATER_FIELDS = {"dense_block": False, "block_size": None, "mask_token_id": None}


def check_head_files(path: str | Path, cfg: HeadConfig, sha256: str) -> None:
    """The weights file is the one config.json records (sha256), and config.json says what the
    weights were saved with: both checked before anything is built from the config."""
    f = Path(path) / "model.safetensors"
    if not f.is_file():
        raise AssetError(f"{f}: missing; the head checkpoint is incomplete")
    if sha256_file(f) != sha256:
        raise AssetError(f"{f}: its sha256 differs from the one recorded in config.json (altered, truncated or "
                         "corrupted)")
    _check_config_record(f, cfg)


def _check_config_record(f: Path, cfg: HeadConfig) -> None:
    """config.json must say what the weights were saved with (model.safetensors' metadata)."""
    try:
        with safe_open(str(f), framework="pt") as st:
            text = (st.metadata() or {}).get(CONFIG_RECORD)
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise AssetError(f"{f}: unreadable ({str(e)[:120]})") from None
    if text is None:
        raise AssetError(f"{f}: no {CONFIG_RECORD} record in its metadata (written by an older headstart); "
                         "re-save the head")
    try:
        saved = json.loads(text)
    except json.JSONDecodeError:
        saved = None
    if not isinstance(saved, dict):
        raise AssetError(f"{f}: its {CONFIG_RECORD} record is not a JSON object")
    have = dataclasses.asdict(cfg)
    later = LATER_FIELDS | {name: saved_without(name, cfg.head_type) for name in EAGLE31_FLAGS}
    for key, default in later.items():  # added after heads were saved: absent means the default
        if key not in saved and have.get(key) == default:
            have.pop(key)
    for key in sorted(set(saved) | set(have)):
        if saved.get(key) != have.get(key):
            raise AssetError(f"{f.parent / 'config.json'}: {key} is {str(have.get(key))[:80]} but the weights were "
                             f"saved with {str(saved.get(key))[:80]} (config.json edited after saving?)")


def load_head_state(head: DraftHead, path: str | Path) -> None:
    """The weights into `head` (its files were checked by `check_head_files` before it was built)."""
    f = Path(path) / "model.safetensors"
    try:
        state = load_file(str(f))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise AssetError(f"{f}: unreadable ({str(e)[:120]})") from None
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise AssetError(f"{f}: tensors missing {missing} / unexpected {unexpected}")
    if getattr(head, "has_draft_vocab", False):
        from headstart.heads.vocab import check_vocab_maps

        try:
            check_vocab_maps(head.d2t, head.t2d, head.config.draft_vocab_size, head.t2d.numel())
        except ValueError as e:
            raise AssetError(f"{f}: the draft vocabulary is damaged ({e})") from None
