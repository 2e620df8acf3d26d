"""The kernel cache heals and never hangs: a truncated or empty .so is rebuilt, a valid build is
imported without writing (a read-only cache works), a read-only cache without one builds into a
temporary directory, a killed build's torch `lock` is removed, and a build held too long by another
process gives torch's kernels instead of a hang. The compile itself is replaced by a copy of a real
build, so these run in seconds."""

import os
import shutil
import warnings
from pathlib import Path

import pytest

import headstart.kernels as kernels
from headstart.errors import OutputError
from headstart.fileio import file_lock


@pytest.fixture(scope="module")
def good_so(tmp_path_factory):
    """A real build of the kernels (the shared one when present, else compiled once here)."""
    if os.environ.get("HEADSTART_KERNELS", "1") == "0" or not shutil.which("c++"):
        pytest.skip("no C++ compiler / kernels off")
    key = kernels.build_key()
    name = f"headstart_rowwise_{key}"
    shared = Path(os.environ["HEADSTART_KERNEL_CACHE"]) / key / f"{name}.so"
    if shared.is_file() and shared.stat().st_size:
        return shared
    d = tmp_path_factory.mktemp("kernels")
    kernels._compile(name, d)
    return d / f"{name}.so"


@pytest.fixture
def cache(tmp_path, monkeypatch, good_so):
    """An empty kernel cache; `builds` lists the directories the (faked) compile ran in."""
    root = tmp_path / "kc"
    monkeypatch.setenv("HEADSTART_KERNEL_CACHE", str(root))
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_module", None)
    builds = []

    def compile_(name, build):
        assert not (build / "lock").exists(), "torch would wait forever on this lock"
        shutil.copy(good_so, build / f"{name}.so")
        builds.append(build)
        return kernels._import(build, name)

    monkeypatch.setattr(kernels, "_compile", compile_)
    key = kernels.build_key()
    return root, root / key, f"headstart_rowwise_{key}.so", builds


def _replace(path, data):
    """Write a new file under the name: the loaded library is mapped, truncating it in place would crash us."""
    tmp = path.with_name("tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _fresh(monkeypatch):
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_module", None)
    return kernels.rowwise()


def test_a_truncated_or_empty_library_is_rebuilt(cache, monkeypatch):
    root, build, so, builds = cache
    assert _fresh(monkeypatch) is not None and builds == [build]
    good = (build / so).read_bytes()
    _replace(build / so, good[: len(good) // 2])  # truncated: importing it would be a bus error
    assert _fresh(monkeypatch) is not None and len(builds) == 2 and (build / so).read_bytes() == good
    _replace(build / so, b"")
    (build / "checksum.json").unlink()
    assert _fresh(monkeypatch) is not None and len(builds) == 3 and (build / so).read_bytes() == good


def test_a_valid_build_is_imported_without_writing(cache, monkeypatch):
    root, build, so, builds = cache
    _fresh(monkeypatch)
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # as if read-only
    assert _fresh(monkeypatch) is not None and len(builds) == 1
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")} == before


def test_a_read_only_cache_without_a_build_builds_into_a_temporary_directory(cache, monkeypatch):
    root, build, so, builds = cache
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.warns(UserWarning, match="read-only and holds no valid build"):
        assert _fresh(monkeypatch) is not None
    assert len(builds) == 1 and root not in builds[0].parents


def test_a_killed_builds_lock_is_removed_and_a_held_build_times_out(cache, monkeypatch):
    root, build, so, builds = cache
    build.mkdir(parents=True)
    (build / "lock").write_text("")  # torch's FileBaton of a build killed with -9
    assert _fresh(monkeypatch) is not None and len(builds) == 1
    (build / "checksum.json").unlink()
    monkeypatch.setattr(kernels, "LOCK_TIMEOUT_S", 0.5)
    with file_lock(root / f"{build.name}.lock"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _fresh(monkeypatch) is None  # torch's kernels, not a hang
    assert any("held the lock" in str(w.message) for w in caught)


def test_a_file_lock_waits_for_a_live_holder_and_not_for_a_silent_one(tmp_path):
    """A holder that works longer than the timeout keeps its waiters (its heartbeat); one that stops
    beating (hung) fails them after the timeout."""
    import fcntl
    import threading
    import time

    done = threading.Event()

    def hold():
        with file_lock(tmp_path / "a.lock", heartbeat=0.1):
            done.wait(1.5)

    t = threading.Thread(target=hold)
    t.start()
    time.sleep(0.3)
    start = time.monotonic()
    with file_lock(tmp_path / "a.lock", timeout=0.5):  # 1.2 s of waiting, 3x the timeout: still fine
        waited = time.monotonic() - start
    t.join()
    assert waited > 0.5
    with open(tmp_path / "b.lock", "w") as f:  # a holder without a heartbeat
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(OutputError, match=r"b.lock for over \ds \(no sign of life for \ds\)"):
            with file_lock(tmp_path / "b.lock", timeout=0.5):
                pass


def test_a_file_lock_wait_ends_at_max_wait_however_alive_the_holder(tmp_path, monkeypatch):
    import threading
    import time

    import headstart.fileio as fileio

    monkeypatch.setattr(fileio, "MAX_WAIT_S", 0.6)
    done, held = threading.Event(), threading.Event()

    def hold():
        with fileio.file_lock(tmp_path / "c.lock", heartbeat=0.05):
            held.set()
            done.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    start = time.monotonic()
    with pytest.raises(OutputError, match=r"c.lock for over \ds; wait"):  # beating, so no "no sign of life"
        with file_lock(tmp_path / "c.lock", timeout=60):
            pass
    assert time.monotonic() - start < 5
    done.set()
    t.join()


def test_file_lock_times_out_with_a_clear_error(tmp_path):
    with file_lock(tmp_path / "x.lock"):
        with pytest.raises(OutputError, match=r"x.lock for over 0s"):
            with file_lock(tmp_path / "x.lock", timeout=0.3):
                pass
