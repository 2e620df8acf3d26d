import json
from pathlib import Path

import pytest

from headstart.errors import DataError, OutputError
from headstart.fileio import atomic_path, iter_jsonl, read_json_array, read_utf8


def test_cut_off_array_keeps_complete_records(tmp_path):
    records = [{"id": i, "text": "é" * i} for i in range(5)]
    full = json.dumps(records, ensure_ascii=False).encode()
    cut = full[: full.index(b'{"id": 4') + 10]
    p = tmp_path / "cut.json"
    p.write_bytes(cut)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)  # what a strict parser does with it
    read = read_json_array(p)
    assert read.records == records[:4]
    assert read.bytes_unparsed == 10 and read.unparsed_at_byte == len(cut) - 10
    assert read.bytes_total == len(cut)


def test_complete_array_and_missing_bracket(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text('[ {"a": 1} , {"a": 2} ]\n')
    r = read_json_array(p)
    assert r.records == [{"a": 1}, {"a": 2}] and r.bytes_unparsed == 0 and r.unparsed_at_byte is None
    p.write_text('[{"a": 1}, ')
    r = read_json_array(p)
    assert r.records == [{"a": 1}] and r.bytes_unparsed == 0 and r.unparsed_at_byte is not None


def test_not_an_array(tmp_path):
    p = tmp_path / "obj.json"
    p.write_text('{"a": 1}')
    with pytest.raises(DataError, match="expected a JSON array"):
        read_json_array(p)


def test_non_utf8_names_byte_and_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl: not UTF-8 text \(byte 32, line 2"):
        read_utf8(p)


def test_jsonl_line_separators_inside_strings(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"t": "a\u2028b\x85c"}, ensure_ascii=False) + "\n\n" + "{bad\n", encoding="utf-8")
    rows = list(iter_jsonl(p))
    assert rows[0] == (1, {"t": "a\u2028b\x85c"}, None)
    assert rows[1][0] == 3 and rows[1][1] is None and "invalid JSON" in rows[1][2]


def test_atomic_path_file_and_failure(tmp_path):
    final = tmp_path / "sub" / "out.txt"
    with atomic_path(final) as tmp:
        tmp.write_text("done")
        assert not final.exists()
    assert final.read_text() == "done"
    with pytest.raises(RuntimeError):
        with atomic_path(final) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert final.read_text() == "done"
    assert [p.name for p in final.parent.iterdir()] == ["out.txt"]


def _write_dir(final, text, **kw):
    with atomic_path(final, **kw) as tmp:
        tmp.mkdir()
        (tmp / "f").write_text(text)


def test_atomic_path_replaces_only_what_it_recognises(tmp_path):
    final = tmp_path / "d"
    ours = lambda p: (p / "f").is_file()  # noqa: E731
    _write_dir(final, "one", replaces=ours)
    _write_dir(final, "two", replaces=ours)
    assert (final / "f").read_text() == "two"
    with pytest.raises(OutputError, match="exists and is not empty"):
        _write_dir(final, "three")  # no recogniser: an existing non-empty directory is never replaced
    assert (final / "f").read_text() == "two"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("user data")
    with pytest.raises(OutputError, match="pass --force"):
        _write_dir(victim, "x", replaces=ours, hint="pass --force")
    assert (victim / "precious").read_text() == "user data"
    empty = tmp_path / "empty"
    empty.mkdir()
    _write_dir(empty, "ok")  # an empty directory holds nothing to lose
    assert (empty / "f").read_text() == "ok"


def test_atomic_path_resolves_and_refuses_dot_dotdot_root_links(tmp_path, monkeypatch):
    runs = tmp_path / "runs" / "x"
    (runs / "victim").mkdir(parents=True)
    (runs / "sibling.txt").write_text("keep")
    for bad in (runs / "victim" / "..", str(runs / "victim") + "/../", ".", "..", "/"):
        with pytest.raises(OutputError):
            _write_dir(Path(bad) if not isinstance(bad, str) else bad, "x")
    assert (runs / "sibling.txt").read_text() == "keep" and (runs / "victim").is_dir()
    link = tmp_path / "link"
    link.symlink_to(runs)
    with pytest.raises(OutputError, match="symbolic link"):
        _write_dir(link, "x")
    monkeypatch.chdir(runs)
    with pytest.raises(OutputError):
        _write_dir("victim/..", "x", replaces=lambda p: True)  # resolved to runs/x, and '..' is refused
    assert sorted(p.name for p in runs.iterdir()) == ["sibling.txt", "victim"]


def test_atomic_path_kind_mismatch_is_refused(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(OutputError, match="is a directory"):
        with atomic_path(d) as tmp:
            tmp.write_text("file")
    assert d.is_dir()
    f = tmp_path / "f"
    f.write_text("keep")
    with pytest.raises(OutputError, match="is a file"):
        _write_dir(f, "x")
    assert f.read_text() == "keep"


def test_jsonl_non_utf8_names_byte_and_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl: not UTF-8 text \(byte 32, line 2"):
        list(iter_jsonl(p))


def test_a_directory_swap_cut_between_its_renames_is_put_back(tmp_path):
    """swap_into_place moves the previous directory aside before renaming the new one in: a kill
    between the two leaves `.NAME.old-PID`, which the next run restores rather than deletes; stale
    temporaries of dead processes are removed, those of live ones kept."""
    import os
    import subprocess

    from headstart.fileio import remove_stale_temporaries, swap_into_place

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f".last.ckpt.old-{dead.pid}").mkdir()
    (tmp_path / f".last.ckpt.old-{dead.pid}" / "meta.pt").write_text("previous")
    (tmp_path / f".last.ckpt.tmp-{dead.pid}").mkdir()  # the new one, half written
    (tmp_path / f".other.tmp-{os.getpid()}").write_text("a live writer's")
    remove_stale_temporaries(tmp_path)
    assert (tmp_path / "last.ckpt" / "meta.pt").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".other.tmp-{os.getpid()}", "last.ckpt"]
    new = tmp_path / ".new"
    new.mkdir()
    (new / "meta.pt").write_text("next")
    swap_into_place(new, tmp_path / "last.ckpt")
    assert (tmp_path / "last.ckpt" / "meta.pt").read_text() == "next"
    assert not list(tmp_path.glob(".last.ckpt.*"))
