"""A long regeneration carried across machines in pieces (`headstart regenerate --pieces DIR`).

A machine that does not keep `runs/` between sessions cannot resume from `<output>.partial`. DIR (a
directory kept with the project, e.g. under version control) holds the run record (`run.json`) and
one gzip'd JSONL file per piece (`part-0001.jsonl.gz`, ...), each with the conversations that piece
finished and no earlier piece holds. Before a run, the pieces' record is checked against the recipe
and the rows of every piece that the partial file lacks are appended to it; after the run (or a
time-boxed stop, or Ctrl-C), the rows no piece holds yet become the next piece. Pieces are written
atomically and never rewritten: a saved piece is never lost by a later one, and reading them back
drops nothing but repeated ids.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from headstart.errors import DataError
from headstart.fileio import atomic_path

RUN = "run.json"


def _number(path: Path) -> int:
    return int(path.name.split("-")[1].split(".")[0])


def _parts(pieces: Path) -> list[Path]:
    return sorted(pieces.glob("part-*.jsonl.gz"), key=_number)


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


def load(pieces: Path) -> tuple[dict | None, list[tuple[str, str]]]:
    """The pieces' run record (None: no piece yet) and their rows, each id once (the first piece's),
    all read and checked before anything is written anywhere."""
    _check(pieces)
    if not (pieces / RUN).is_file():
        return None, []
    try:
        record = json.loads((pieces / RUN).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{pieces / RUN}: not a readable run record ({e})") from None
    if not isinstance(record, dict):
        raise DataError(f"{pieces / RUN}: not a run record (a JSON object)")
    seen: set[str] = set()
    rows = []
    for part in _parts(pieces):
        for rid, line in _rows(part):
            if rid not in seen:
                seen.add(rid)
                rows.append((rid, line))
    return record, rows


def append_missing(path: Path, rows: list[tuple[str, str]]) -> int:
    """Append to a JSONL file the rows whose ids it lacks (a torn last line, from a kill mid-write, is
    cut off first); returns how many were added."""
    data = path.read_bytes() if path.exists() else b""
    keep = data[: data.rfind(b"\n") + 1]
    have = {json.loads(line)["id"] for line in keep.decode("utf-8").split("\n")[:-1]}
    new = [line for rid, line in rows if rid not in have and not have.add(rid)]
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(len(keep))
        f.seek(len(keep))
        f.write("".join(line + "\n" for line in new).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    return len(new)


def _pieces_record(path: Path) -> dict | None:
    """The pieces' record as save finds it (None: none, or unreadable: it is replaced)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def save(pieces: Path, rows_file: Path, run_file: Path) -> Path | None:
    """Write the rows of `rows_file` that no piece holds as the next piece (None: nothing new), and the
    run record as the pieces' one where it changed (the source limit may have grown) or rows are added (the
    record names the engine that made the last piece; a restore that adds nothing leaves it as it was)."""
    _check(pieces)
    pieces.mkdir(parents=True, exist_ok=True)
    held = {rid for part in _parts(pieces) for rid, _ in _rows(part)}
    data = rows_file.read_bytes() if rows_file.exists() else b""
    lines = data[: data.rfind(b"\n") + 1].decode("utf-8").split("\n")[:-1]
    new = [line for line in lines if json.loads(line)["id"] not in held]
    record, held_record = json.loads(run_file.read_text(encoding="utf-8")), _pieces_record(pieces / RUN)
    if not new and held_record is not None:  # no new rows: the record still names the engine of the last piece
        record = {k: v for k, v in record.items() if k != "engine"}
        record.update({"engine": held_record["engine"]} if "engine" in held_record else {})
    if record != held_record:
        with atomic_path(pieces / RUN) as tmp:
            tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    if not new:
        return None
    parts = _parts(pieces)
    path = pieces / f"part-{(_number(parts[-1]) if parts else 0) + 1:04d}.jsonl.gz"
    with atomic_path(path) as tmp:
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
            f.write("".join(line + "\n" for line in new))
    return path
