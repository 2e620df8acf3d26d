"""A long regeneration carried across machines in pieces (`headstart regenerate --pieces DIR`).

A machine that does not keep `runs/` between sessions cannot resume from `<output>.partial`. DIR (a
directory kept with the project, e.g. under version control) holds the run record (`run.json`) and
one gzip'd JSONL file per piece (`part-0001.jsonl.gz`, ...), each with the conversations that piece
finished and no earlier piece holds. Before a run, the rows of every piece that the partial file
lacks are appended to it (and the run record is copied beside it); after the run, the rows no piece
holds yet become the next piece. Pieces are written atomically and never rewritten: a piece that
was saved is never lost by a later one, and reading them back drops nothing but repeated ids.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

from headstart.errors import DataError
from headstart.fileio import atomic_path

RUN = "run.json"


def _parts(pieces: Path) -> list[Path]:
    return sorted(pieces.glob("part-*.jsonl.gz"))


def _check(pieces: Path) -> None:
    if pieces.exists() and not pieces.is_dir():
        raise DataError(f"--pieces {pieces}: not a directory")
    if pieces.is_dir() and any(pieces.iterdir()) and not (pieces / RUN).is_file():
        raise DataError(f"--pieces {pieces}: a directory with files but no {RUN}: not one regenerate made; "
                        "name a new or empty directory")


def _rows(path: Path) -> list[tuple[str, str]]:
    """(id, line) of every row of a piece; a piece that does not read back is named, not skipped."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot be read as gzip'd JSONL ({e})") from None
    out = []
    for n, line in enumerate(text.split("\n")[:-1], 1):  # not splitlines(): U+2028 etc. occur inside JSON strings
        try:
            out.append((json.loads(line)["id"], line))
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path}: row {n} is not a regenerated conversation (JSON with an 'id')") from None
    return out


def _ids_in(path: Path) -> set[str]:
    if not path.exists():
        return set()
    data = path.read_bytes()
    lines = data[: data.rfind(b"\n") + 1].decode("utf-8").split("\n")[:-1]
    return {json.loads(line)["id"] for line in lines}


def restore(pieces: Path, partial: Path, run_file: Path, out: Path) -> int:
    """Append to `partial` the rows of every piece it lacks; copy the run record if there is none.
    Returns how many rows were added."""
    _check(pieces)
    if not (pieces / RUN).is_file():
        return 0
    if run_file.exists():
        ours, theirs = json.loads(run_file.read_text()), json.loads((pieces / RUN).read_text())
        # the source limit may grow between pieces (regenerate checks that against the recipe)
        diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k) and k != "limit")
        if diff:
            raise DataError(f"--pieces {pieces}: its {RUN} differs from {run_file} in {', '.join(diff)}; "
                            "the pieces belong to another run")
    else:
        run_file.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pieces / RUN, run_file)
    have = _ids_in(partial) | _ids_in(out)
    added = 0
    with open(partial, "a", encoding="utf-8") as f:
        for part in _parts(pieces):
            for rid, line in _rows(part):
                if rid not in have:
                    f.write(line + "\n")
                    have.add(rid)
                    added += 1
        f.flush()
        os.fsync(f.fileno())
    return added


def save(pieces: Path, rows_file: Path, run_file: Path) -> Path | None:
    """Write the rows of `rows_file` that no piece holds as the next piece (None: nothing new)."""
    _check(pieces)
    pieces.mkdir(parents=True, exist_ok=True)
    with atomic_path(pieces / RUN) as tmp:  # the latest record: the limit may have grown
        shutil.copyfile(run_file, tmp)
    held = {rid for part in _parts(pieces) for rid, _ in _rows(part)}
    data = rows_file.read_bytes().decode("utf-8") if rows_file.exists() else ""
    new = [line for line in data.split("\n")[:-1] if json.loads(line)["id"] not in held]
    if not new:
        return None
    parts = _parts(pieces)
    number = int(parts[-1].name.split("-")[1].split(".")[0]) + 1 if parts else 1
    path = pieces / f"part-{number:04d}.jsonl.gz"
    with atomic_path(path) as tmp:
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
            f.write("".join(line + "\n" for line in new))
    return path
