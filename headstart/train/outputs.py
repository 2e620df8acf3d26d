"""What `headstart train` may write into, checked before the target loads.

A training output_dir is new or empty, or recognisably headstart's: a previous run (its train.json
carries our `format`), or what the other verbs of the same recipe put there (precompute's shards,
regenerate's JSONL, an eval report). Anything else is the user's and is refused, so a dataset named
train.json is never replaced by a run record. The subdirectories training writes into are never
symbolic links (a planted `checkpoints -> elsewhere` would receive last.ckpt).
"""

from __future__ import annotations

import csv
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

from headstart.config import Recipe
from headstart.errors import ConfigError, DataError, OutputError
from headstart.fileio import atomic_write_text, check_output_path, read_json_object, remove_stale_temporaries

FORMAT = "headstart-train/1"
PRECOMPUTE_FORMAT = "headstart-precompute/1"
# Outputs of a training run; an output_dir holding any of them without train.json is someone else's.
RUN_OUTPUTS = ("metrics.csv", "metrics.json", "checkpoints", "head-final", "head-best")
# Subdirectories training writes into: a symbolic link there would send our files elsewhere.
WRITTEN_DIRS = ("checkpoints", "head-final", "head-best", "lightning_logs")
LOCK = ".train.lock-rank{rank}"
SHARDED_META = "meta.pt"  # Lightning's file beside the shards of a distributed checkpoint


def lock_path(out: Path, rank: int) -> Path:
    return out / LOCK.format(rank=rank)


def check_output_dir(recipe: Recipe, resume: bool) -> Path:
    """The resolved output_dir, or an error naming what in it headstart did not write."""
    out = check_output_path(recipe.output_dir, replaces=lambda p: True)  # '.', '..', root, links
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {out} is a file; choose a directory")
    for name in WRITTEN_DIRS:
        if (out / name).is_symlink():
            raise OutputError(f"{out / name}: is a symbolic link; training writes there and never follows a link "
                              "out of output_dir (remove the link, or choose another output_dir)")
    info = out / "train.json"
    if info.exists():
        if not is_run_record(info):
            raise ConfigError(f"{info}: is not a headstart training record (no \"format\": \"{FORMAT}\"); it is "
                              "left alone: choose another output_dir")
    elif out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if not _ours(p, recipe))
        if foreign:
            listed = ", ".join(foreign[:5]) + (f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else "")
            raise ConfigError(f"{out} holds {listed} that no training run of headstart wrote (no train.json); "
                              "choose a new or empty output_dir")
    if resume and (out / "checkpoints" / "last.ckpt").exists():
        checkpoint_step(out / "checkpoints" / "last.ckpt", recipe.train.max_steps)
    return out


def is_run_record(path: Path) -> bool:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and obj.get("format") == FORMAT


def _ours(p: Path, recipe: Recipe) -> bool:
    """An entry of a record-less output_dir that a headstart verb of this recipe wrote."""
    from headstart.eval_report import is_report_dir
    from headstart.precompute.regenerate import output_path

    if p.name.startswith(".train.lock-rank") or p.name.startswith(".lock-rank"):
        return True
    regenerated = output_path(recipe).resolve()
    if p.resolve() in (regenerated, regenerated.with_name(regenerated.name + ".partial"),
                       regenerated.with_name(regenerated.name + ".run.json")):
        return True
    if _is_precompute_dir(p.parent):  # output_dir is precompute's own directory
        return p.name in ("run.json", "manifest.json") or p.name.startswith(("shard-", ".shard-"))
    return p.is_dir() and not p.is_symlink() and (_is_precompute_dir(p) or is_report_dir(p))


def _is_precompute_dir(d: Path) -> bool:
    """precompute's output: its run.json names our format, or it holds only its locks (died early)."""
    run = d / "run.json"
    if run.is_file():
        try:
            return json.loads(run.read_text(encoding="utf-8")).get("format") == PRECOMPUTE_FORMAT
        except (OSError, ValueError, AttributeError):
            return False
    names = [p.name for p in d.iterdir()] if d.is_dir() else []
    return bool(names) and all(n.startswith(".lock-rank") for n in names)


def checkpoint_step(path: Path, max_steps: int | None = None) -> int:
    """The optimizer step a Lightning last.ckpt was written at: a file, or under FSDP a directory of
    the ranks' shards (torch.distributed.checkpoint's .metadata) and Lightning's meta.pt; what is
    not one is a DataError naming it. With `max_steps`, a resume that would train nothing is refused."""
    import torch

    damaged = (f"{path}: damaged or not a headstart training checkpoint; restore it from a copy, or delete the "
               "checkpoints directory to start over")
    state = path
    if path.is_dir():
        missing = [n for n in (SHARDED_META, ".metadata") if not (path / n).is_file()]
        if missing:
            raise DataError(damaged + f" (a sharded checkpoint without its {' and '.join(missing)})")
        _check_shards(path, damaged)
        state = path / SHARDED_META
    if not zipfile.is_zipfile(state):
        raise DataError(damaged + " (not a complete checkpoint archive)")
    try:
        # weights_only: a checkpoint is read as data; a file that needs arbitrary objects is not ours.
        ckpt: Any = torch.load(state, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile):
        raise DataError(damaged) from None
    step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
    weights = path.is_dir() or isinstance(ckpt.get("state_dict"), dict)  # a sharded one keeps them in shards
    if not isinstance(step, int) or not weights or "loops" not in ckpt:
        raise DataError(damaged + " (no Lightning state)")
    if max_steps is not None and 0 < max_steps <= step:
        raise ConfigError(f"--resume: {path} is at step {step} and train.max_steps is {max_steps}; nothing would "
                          f"be trained: raise train.max_steps above {step} (--set train.max_steps=N)")
    return step


def check_checkpoint_head(path: Path, head: Any) -> None:
    """A checkpoint to resume holds a head of the recipe's type and shape (a last.ckpt copied from
    another run is named here, not by a traceback about missing keys once Lightning loads it)."""
    import torch

    want = head.config.head_type
    ckpt: Any = torch.load(path / SHARDED_META if path.is_dir() else path, map_location="cpu", weights_only=True,
                           mmap=not path.is_dir())
    recorded = (ckpt.get("headstart") or {}).get("head_type")
    if recorded is not None and recorded != want:
        raise ConfigError(f"--resume: {path} holds a {str(recorded)[:40]} head but the recipe trains a {want} head "
                          "(head.type); resume with the recipe that wrote it, or choose another output_dir")
    state = ckpt.get("state_dict")
    if isinstance(state, dict):  # a file checkpoint: its head's tensors by name and shape
        have = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        need = {f"head.{k}": tuple(v.shape) for k, v in head.state_dict().items()}
        missing = sorted(k for k in need if k not in have)
        unexpected = sorted(k for k in have if k not in need)
        shapes = sorted(k for k in need if k in have and have[k] != need[k])
        if missing or unexpected or shapes:
            what = f"a {recorded} head of another shape" if recorded else "another head (an older checkpoint " \
                                                                          "that does not record its type)"
            detail = "; ".join(f"{label} {names[:3]}" for label, names in (
                ("missing", missing), ("unexpected", unexpected), ("other shapes", shapes)) if names)
            raise ConfigError(f"--resume: {path} holds {what}, not the recipe's {want} head ({detail}); resume with "
                              "the recipe that wrote it, or choose another output_dir")


def _check_shards(path: Path, damaged: str) -> None:
    """Every byte range torch.distributed.checkpoint's .metadata names is in its shard file (a shard
    cut short or deleted is named here, not found by a reader's traceback mid-load)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception:  # a damaged .metadata raises pickle's, torch's or the reader's own errors
        raise DataError(damaged + " (its .metadata cannot be read)") from None
    ends: dict[str, int] = {}
    for item in (meta.storage_data or {}).values():
        name = str(item.relative_path)
        ends[name] = max(ends.get(name, 0), int(item.offset) + int(item.length))
    for name, end in sorted(ends.items()):
        f = path / name
        if not f.is_file():
            raise DataError(damaged + f" (the shard {name} is missing)")
        if f.stat().st_size < end:
            raise DataError(damaged + f" (the shard {name} is cut short: {f.stat().st_size:,} of {end:,} bytes)")


def check_resume(out: Path, identity: dict[str, Any], resume: bool, rank: int = 0) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run; refuses what would mix two runs.
    Rank 0 decides for a fresh run (the other ranks start after it has written train.json)."""
    from headstart.heads.checkpoint import check_head_output

    info, last = out / "train.json", out / "checkpoints" / "last.ckpt"
    if not resume and rank != 0:
        return None
    if not resume:
        if last.exists():
            raise ConfigError(f"{out} holds a training run already; pass --resume to continue it, or choose "
                              "another output_dir")
        foreign = [n for n in RUN_OUTPUTS if (out / n).exists()]
        if foreign and not info.exists():
            raise ConfigError(f"{out} holds {', '.join(foreign)} that no training run of headstart wrote (no "
                              "train.json); choose another output_dir")
        for name in ("head-final", "head-best"):
            check_head_output(out / name, overwrite=True)  # refused up front, not after hours of training
        return None  # a run that died before its first checkpoint starts afresh
    if not info.exists() or not last.exists():
        raise ConfigError(f"--resume: {out} holds no checkpoint to resume (train.json / checkpoints/last.ckpt); "
                          "run without --resume to start")
    prev = read_json_object(info, "training run record")
    diffs = []
    for key in ("target_fingerprint", "data_fingerprint"):
        if prev.get(key) != identity[key]:
            diffs.append(f"{key.split('_')[0]} ({str(prev.get(key))[:12]}… -> {identity[key][:12]}…)")
    old, new = prev.get("recipe", {}), identity["recipe"]
    was, now = old.get("resolved.world_size"), new.get("resolved.world_size")
    if was is not None and was != now:
        raise ConfigError(f"--resume: {out} was trained on {was} ranks and this launch has {now}; the data order "
                          "(and a sharded checkpoint's files) are per rank: resume with trainer.devices x "
                          f"trainer.num_nodes = {was}")
    defaults = flat_recipe(Recipe().to_dict())
    for key in sorted(set(old) | set(new)):
        if key not in old and (key not in defaults or new.get(key) == defaults[key]):
            continue  # recorded by an older headstart that did not know this key: it ran as the default
        was = old[key] if key in old else defaults[key]
        if was != new.get(key):
            diffs.append(f"{key} ({_differing(was, new.get(key))})")
    if diffs:
        raise ConfigError(f"--resume: {out} was trained with a different " + "; ".join(diffs[:8]) +
                          "; resume with the same recipe or choose another output_dir")
    return last


def _differing(a: Any, b: Any, width: int = 40) -> str:
    """'a -> b' as reprs, each cut to `width` characters around where they first differ (two long paths that
    share their first 40 characters would otherwise read the same)."""
    ra, rb = repr(a), repr(b)
    if max(len(ra), len(rb)) <= width:
        return f"{ra} -> {rb}"
    at = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
    start = max(0, min(at - width // 2, max(len(ra), len(rb)) - width))

    def cut(r: str) -> str:
        return ("…" if start else "") + r[start:start + width] + ("…" if start + width < len(r) else "")
    return f"{cut(ra)} -> {cut(rb)}"


def flat_recipe(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A recipe's nested dict as dotted keys ("train.lr": 0.004)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_recipe(v, key + "."))
        else:
            out[key] = v
    return out


def remove_crash_leftovers(out: Path) -> None:
    """Temporaries of a killed run (`.last.ckpt.tmp-PID`, `.head-best.tmp-PID`, ...) whose PID is gone."""
    for d in (out, out / "checkpoints"):
        remove_stale_temporaries(d)


class CurveWriter:
    """metrics.csv: one row per logged train step or validation (rank 0); rows past a resumed step are dropped."""

    FIELDS = ["kind", "step", "tokens", "loss", "lr", "tok_s", "val_loss", "tau", "alpha", "top1_per_step",
              "sampled_accept_per_step", "accept_rate_per_pos"]

    def __init__(self, path: Path) -> None:
        self.path = path

    def start(self, step: int) -> None:
        """Keep the rows of steps <= `step` (0 on a fresh run; a row cut by a crash is dropped), written
        atomically; later rows are appended."""
        import io

        rows = []
        if step and self.path.exists():
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= step
                        and r.get(self.FIELDS[-1]) is not None]
            for r in rows:  # a curve written before the column was renamed
                if "expected_accept_per_step" in r:
                    r.setdefault("sampled_accept_per_step", r.pop("expected_accept_per_step"))
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        atomic_write_text(self.path, buf.getvalue())

    def add(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.FIELDS).writerow(
                {k: (json.dumps(v) if isinstance(v, list) else v) for k, v in row.items() if k in self.FIELDS})


def resumed_init_sha(out: Path, init_from: str | None) -> str | None:
    """--resume: the sha256 of the head.init_from the run started from, as its train.json recorded it (the
    initial head may have moved or been replaced since: it is not read; the checkpoint holds the weights). A
    resume that adds or drops head.init_from is refused."""
    info = out / "train.json"
    if not info.is_file():
        return None  # check_resume says there is nothing to resume
    sha = read_json_object(info, "training run record").get("recipe", {}).get("resolved.init_from_sha256")
    if bool(sha) != bool(init_from):
        raise ConfigError(f"--resume: {out} started from head.init_from (weights sha256 {str(sha)[:12]}…): set "
                          "head.init_from again (a resume does not read it: any path)" if sha else
                          f"--resume: {out} started from a new head: head.init_from does not apply to its resume; "
                          "leave it out")
    return sha
