"""Small file helpers shared by every stage: atomic writes, locks, tolerant JSON readers.

Everything that writes a result goes through `atomic_path`/`atomic_write_text` so that a crash
never leaves a half-written file under its final name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headstart.errors import DataError, HeadstartError, OutputError


@contextlib.contextmanager
def atomic_path(final: Path, *, replaces: Callable[[Path], bool] | None = None, hint: str = "") -> Iterator[Path]:
    """Yield a temporary sibling path; on success rename it to `final` (file or directory).

    A writer never deletes what it did not create. An existing file is replaced (that is what an
    atomic rewrite is for), but an existing directory only when it is empty or when `replaces(final)`
    recognises it as a previous output of the same kind; anything else is refused before any work
    is done, with `hint` (e.g. "pass --force") appended. The path is resolved first, so `x/..` names
    `x`'s parent, and `.`, `..`, the filesystem root and symbolic links are never targets.
    On an exception the temporary is removed and `final` is untouched.
    """
    final = check_output_path(final, replaces=replaces, hint=hint)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{final.parent}: cannot create the output directory ({e.strerror})") from None
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    remove_path(tmp)
    try:
        yield tmp
        # Checked again: the directory may have appeared while the output was being built.
        check_output_path(final, replaces=replaces, hint=hint)
        swap_into_place(tmp, final)
    finally:
        remove_path(tmp)


def swap_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` (a file or a directory) to `final`. A directory at `final` is first moved aside
    to `.NAME.old-PID` and deleted only after the swap; a crash between the two renames leaves it
    there, and remove_stale_temporaries puts it back."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    remove_path(old)  # a leftover of this PID's earlier swap would make the rename below fail
    if final.is_dir():
        if tmp.is_dir() or tmp.is_symlink() or not tmp.exists():
            os.replace(final, old)  # empty or recognised: moved aside, deleted only after the swap
        else:
            raise OutputError(f"{final}: is a directory; a file was to be written there")
    elif final.exists() and tmp.is_dir():
        raise OutputError(f"{final}: is a file; a directory was to be written there")
    try:
        os.replace(tmp, final)
    except OSError:
        if old.exists() and not final.exists():
            os.replace(old, final)  # the previous output stays
        raise
    remove_path(old)


def check_output_path(path: str | Path, *, replaces: Callable[[Path], bool] | None = None, hint: str = "") -> Path:
    """Resolve an output path and refuse targets a writer must never replace (see `atomic_path`)."""
    raw = str(path)
    if raw.rstrip("/").rsplit("/", 1)[-1] in ("", ".", ".."):
        raise OutputError(f"{raw!r}: '.' and '..' are not output paths; name a new directory, e.g. runs/my-head")
    given = Path(raw).expanduser()
    if given.is_symlink():
        raise OutputError(f"{raw}: is a symbolic link; give the real path of a new output")
    final = given.resolve()
    if final == Path(final.anchor):
        raise OutputError(f"{raw}: the filesystem root is not an output path")
    if final.is_dir() and any(final.iterdir()) and not (replaces is not None and replaces(final)):
        msg = f"{final}: exists and is not empty; refusing to replace a directory this writer did not create"
        raise OutputError(msg + (f" ({hint})" if hint else "; choose a new path"))
    there = final.parent  # writers create a temporary beside the output, then rename it
    while not there.exists() and there != there.parent:
        there = there.parent
    for where in ([there] + ([final] if final.is_dir() else [])):  # an existing output is written into too
        if where.is_dir() and not os.access(where, os.W_OK | os.X_OK):  # found now, not after the work
            raise OutputError(f"{where}: cannot be written (a read-only file system or no permission), so {raw} "
                              "cannot be written; choose another output path")
    return final


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise OutputError(f"{path}: cannot be written ({e.strerror or e}); nothing was changed") from None


def read_json_object(path: Path, what: str = "file") -> dict[str, Any]:
    """A JSON object from a file the user may have damaged: anything else is a DataError naming it."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: the {what} is not valid JSON ({str(e)[:80]}); it is damaged") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: the {what} should be a JSON object (expected a JSON object, got "
                        f"{type(obj).__name__}); it is damaged")
    return obj


def apply_umask(path: Path) -> None:
    """Give a file written by a library that creates 0600 files (safetensors) the mode the user's
    umask asks for, like every other file we write."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def remove_path(path: Path) -> None:
    """Delete a file, a link or a directory tree, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _open_lock_file(path: Path) -> Any:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a+")
    except OSError as e:
        raise OutputError(f"{path.parent}: cannot be written ({e.strerror or e})") from None


def _same_file(f: Any, path: Path) -> bool:
    """Whether the open file `f` is still the file named `path` (not unlinked or replaced since)."""
    try:
        here, there = os.fstat(f.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


@contextlib.contextmanager
def exclusive_lock(path: Path, what: str) -> Iterator[None]:
    """Hold `path` exclusively for `what`, or refuse at once naming the process that holds it.
    A refusal inside (a HeadstartError) removes the lock file, and its directory, if this call
    created them: a refused run leaves nothing behind in the user's directory."""
    made_dir, made_file = not path.parent.exists(), not path.exists()
    for _ in range(100):
        f = _open_lock_file(path)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read(100).strip() or "another process"
            f.close()
            raise OutputError(f"{what}: already running (pid {holder}, lock {path}); wait for it to finish") from None
        if _same_file(f, path):
            break
        # the holder we waited on removed the file while we held it open: our lock is on a name nobody
        # else can reach, and a newcomer could lock a new file of the same name; lock the new one instead
        f.close()
    else:
        raise OutputError(f"{what}: the lock {path} kept being replaced while taking it")
    with f:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        except HeadstartError:
            if made_file:
                with contextlib.suppress(OSError):
                    path.unlink()
                    if made_dir:
                        path.parent.rmdir()  # only when empty
            raise
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


HEARTBEAT_S = 10.0  # how often a file_lock holder shows it is alive
MAX_WAIT_S = 24 * 3600.0  # the longest any file_lock wait lasts, however alive the holder


@contextlib.contextmanager
def file_lock(path: Path, timeout: float = 600.0, what: str = "the cache entry",
              heartbeat: float = HEARTBEAT_S) -> Iterator[None]:
    """An exclusive advisory lock, so two processes never build the same cache entry at once.

    The kernel drops the lock when its holder dies. A live holder touches the lock file every
    `heartbeat` seconds, so a waiter waits as long as the holder works (the first rank tokenising a
    large dataset for eight others), up to MAX_WAIT_S; a holder silent for `timeout` seconds (hung,
    or on another host of a shared file system that stopped) is an error naming the lock."""
    import threading
    import time

    f = _open_lock_file(path)
    with f:
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                try:
                    silent = time.time() - os.stat(path).st_mtime
                except OSError:
                    silent = 0.0
                if min(silent, now - start) >= timeout or now - start >= MAX_WAIT_S:
                    quiet = f" (no sign of life for {silent:.0f}s)" if silent >= timeout else ""
                    raise OutputError(f"{what}: another process has held the lock {path} for over "
                                      f"{now - start:.0f}s{quiet}; wait for it to finish, or stop it") from None
                time.sleep(0.2)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(heartbeat):
                with contextlib.suppress(OSError):
                    os.utime(path)

        os.utime(path)
        thread = threading.Thread(target=beat, name="headstart-lock-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale_temporaries(directory: Path) -> None:
    """Remove `.NAME.tmp-PID` / `.NAME.old-PID` siblings (see `atomic_path`) left by a process that
    was killed; those of live processes (another rank, another run) are left alone. An `.old` whose
    NAME is missing is the previous output of a swap cut between its two renames: it is put back."""
    if not directory.is_dir() or directory.is_symlink():
        return
    for p in directory.glob(".*.*-*"):
        kind, _, pid = p.name.rpartition("-")
        if not (pid.isdigit() and kind.endswith((".tmp", ".old"))):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            final = directory / kind[1:].removesuffix(".old")
            if kind.endswith(".old") and not final.exists() and not final.is_symlink():
                os.replace(p, final)
            else:
                remove_path(p)
        except PermissionError:
            pass  # alive, someone else's


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_utf8(path: Path) -> str:
    """The whole file as text; a non-UTF-8 byte is an error naming the byte offset and line."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}: not UTF-8 text (byte {e.start}, line {line}: {data[e.start:e.start + 4]!r}); "
            "convert the file to UTF-8"
        ) from None


@dataclass
class JsonArrayRead:
    """The outcome of reading a JSON array element by element."""

    records: list[Any]
    bytes_total: int
    bytes_unparsed: int  # bytes at the end that did not form a complete element
    unparsed_at_byte: int | None  # byte offset where the unparsable tail starts


def read_json_array(path: Path) -> JsonArrayRead:
    """Decode a top-level JSON array one element at a time.

    A strict parser rejects a file that was cut off mid-record; this keeps every complete element
    before the cut and reports how many bytes at the end could not be parsed.
    """
    text = read_utf8(path)
    decoder = json.JSONDecoder()
    n = len(text)
    pos = _skip_ws(text, 0)
    if pos >= n or text[pos] != "[":
        raise DataError(f"{path}: expected a JSON array ('[' at the start); use .jsonl for one object per line")
    pos = _skip_ws(text, pos + 1)
    records: list[Any] = []
    failed_at: int | None = None
    while pos < n and text[pos] != "]":
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            failed_at = pos
            break
        records.append(obj)
        pos = _skip_ws(text, end)
        if pos < n and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        elif pos < n and text[pos] != "]":
            failed_at = pos
            break
    if failed_at is None and pos >= n:
        failed_at = n  # the closing bracket is missing, but every element was complete
    total = len(text.encode("utf-8"))
    if failed_at is None:
        return JsonArrayRead(records, total, 0, None)
    at_byte = len(text[:failed_at].encode("utf-8"))
    return JsonArrayRead(records, total, total - at_byte, at_byte)


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any | None, str | None]]:
    """Yield (line_number, object, error) for each non-blank line; error names the JSON problem.

    Streams the file (a reader that stops after `limit` rows reads only those), splitting on "\n"
    only: str.splitlines() would also break on U+2028, U+0085, ... inside JSON strings. A non-UTF-8
    line is an error naming its byte offset and line."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}: not UTF-8 text (byte {offset + e.start}, line {lineno}: "
                    f"{raw[e.start:e.start + 4]!r}); convert the file to UTF-8"
                ) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line), None
            except json.JSONDecodeError as e:
                yield lineno, None, f"invalid JSON ({e.msg} at column {e.colno})"
