"""A regeneration carried across machines in pieces (--pieces) and cut into time-boxed runs
(--minutes): what the pieces add up to is what one uninterrupted run writes."""

import dataclasses
import gzip
import json
import shutil

import pytest
from test_regenerate import _recipe

from headstart.errors import DataError
from headstart.precompute.pieces import save
from headstart.precompute.regenerate import run_regenerate


@pytest.fixture
def model_dir(chat_model_dir):
    return chat_model_dir


def _limit(recipe, n):
    return dataclasses.replace(recipe, regenerate=dataclasses.replace(recipe.regenerate, limit=n))


def _without_limit(text):
    """Rows keep the source limit they were made under (a grown run's first rows say the smaller one)."""
    rows = [json.loads(x) for x in text.splitlines()]
    for r in rows:
        r["regenerated"].pop("limit")
    return rows


def _piece_ids(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["id"] for line in f]


def test_pieces_on_fresh_machines_add_up_to_one_uninterrupted_run(tmp_path, model_dir):
    whole = run_regenerate(_recipe(tmp_path, model_dir, "whole", temperature=0.8), progress=False).read_text()
    pieces = tmp_path / "kept" / "pieces"
    first = run_regenerate(_limit(_recipe(tmp_path, model_dir, "m1", temperature=0.8), 4), progress=False,
                           pieces=pieces)
    assert sorted(p.name for p in pieces.iterdir()) == ["part-0001.jsonl.gz", "run.json"]
    assert _piece_ids(pieces / "part-0001.jsonl.gz") == [json.loads(x)["id"] for x in first.read_text().splitlines()]
    # a second machine: no runs/ of the first; the pieces restore its rows and the run goes on from there
    shutil.rmtree(tmp_path / "m1")
    out = run_regenerate(_recipe(tmp_path, model_dir, "m2", temperature=0.8), progress=False, pieces=pieces)
    assert _without_limit(out.read_text()) == _without_limit(whole)
    assert len(_piece_ids(pieces / "part-0002.jsonl.gz")) == 9 - 4
    # a third: everything is in the pieces, nothing is decoded, the same file comes out
    again = run_regenerate(_recipe(tmp_path, model_dir, "m3", temperature=0.8), progress=False, pieces=pieces)
    assert again.read_text() == out.read_text()
    assert len(list(pieces.glob("part-*"))) == 2  # no empty piece
    assert json.loads((pieces / "run.json").read_text())["limit"] is None  # the grown run's record


def test_a_machine_that_kept_its_partial_file_takes_only_the_rows_it_lacks(tmp_path, model_dir):
    pieces = tmp_path / "pieces"
    recipe = _recipe(tmp_path, model_dir, "kept")
    run_regenerate(_limit(recipe, 3), progress=False, pieces=pieces)
    out = run_regenerate(recipe, resume=True, progress=False, pieces=pieces)  # limit grown, same machine
    rows = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert len(rows) == len(set(rows)) == 9
    assert [len(_piece_ids(p)) for p in sorted(pieces.glob("part-*"))] == [3, 6]


def test_a_time_boxed_run_stops_resumable_and_its_piece_is_kept(tmp_path, model_dir):
    whole = run_regenerate(_recipe(tmp_path, model_dir, "whole"), progress=False).read_text()
    pieces = tmp_path / "pieces"
    recipe = _recipe(tmp_path, model_dir, "boxed")
    left = run_regenerate(recipe, progress=False, minutes=1e-9, pieces=pieces)  # stops before its first step
    assert left.name == "regenerated.jsonl.partial" and not (tmp_path / "boxed" / "regenerated.jsonl").exists()
    assert (pieces / "run.json").is_file() and not list(pieces.glob("part-*"))
    out = run_regenerate(recipe, resume=True, progress=False, minutes=60)
    assert out.read_text() == whole
    with pytest.raises(DataError, match="--minutes"):
        run_regenerate(_recipe(tmp_path, model_dir, "zero"), progress=False, minutes=0)


def test_pieces_of_another_run_or_a_foreign_directory_are_refused(tmp_path, model_dir):
    pieces = tmp_path / "pieces"
    run_regenerate(_limit(_recipe(tmp_path, model_dir, "a"), 2), progress=False, pieces=pieces)
    hotter = _recipe(tmp_path, model_dir, "b", temperature=0.5)
    with pytest.raises(DataError, match="temperature"):
        run_regenerate(hotter, progress=False, pieces=pieces)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="no run.json"):
        run_regenerate(_recipe(tmp_path, model_dir, "c"), progress=False, pieces=foreign)
    assert (foreign / "notes.txt").read_text() == "mine" and len(list(foreign.iterdir())) == 1
    broken = tmp_path / "broken"
    shutil.copytree(pieces, broken)
    with gzip.open(broken / "part-0002.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write('{"id": "c0"}\nnot json\n')
    with pytest.raises(DataError, match=r"part-0002.jsonl.gz: row 2"):
        run_regenerate(_recipe(tmp_path, model_dir, "d"), progress=False, pieces=broken)


def test_a_torn_partial_file_and_repeated_ids_in_pieces_are_restored_cleanly(tmp_path, model_dir):
    pieces = tmp_path / "pieces"
    run_regenerate(_limit(_recipe(tmp_path, model_dir, "a"), 3), progress=False, pieces=pieces)
    first = gzip.open(pieces / "part-0001.jsonl.gz", "rt", encoding="utf-8").read().splitlines()
    with gzip.open(pieces / "part-0002.jsonl.gz", "wt", encoding="utf-8") as f:  # a repeat of an id of piece 1
        f.write(first[0] + "\n")
    recipe = _recipe(tmp_path, model_dir, "b")
    run_regenerate(_limit(recipe, 1), progress=False, minutes=1e-9)  # b's own unfinished run: record, no rows
    partial = tmp_path / "b" / "regenerated.jsonl.partial"
    partial.write_text(first[0] + "\n" + first[1][:40])  # killed mid-write
    out = run_regenerate(_limit(recipe, 3), progress=False, pieces=pieces)
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert ids == ["c0", "c1", "c2"]


def test_a_grown_finished_run_keeps_the_rows_other_machines_made(tmp_path, model_dir, monkeypatch):
    import headstart.precompute.regenerate as regen

    pieces = tmp_path / "pieces"
    a = _recipe(tmp_path, model_dir, "a")
    run_regenerate(_limit(a, 3), progress=False, pieces=pieces)  # machine A: c0-c2, finished
    run_regenerate(_limit(_recipe(tmp_path, model_dir, "b"), 6), progress=False, pieces=pieces)  # B: c3-c5
    asked = []
    real = regen._converse
    monkeypatch.setattr(regen, "_converse", lambda feed, todo, *rest: asked.extend(c["id"] for c in todo)
                        or real(feed, todo, *rest))
    out = run_regenerate(_limit(a, 8), resume=True, progress=False, pieces=pieces)  # back on A, grown
    assert asked == ["c6", "c7"]  # B's rows were taken, not decoded again
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [f"c{i}" for i in range(8)]


def test_refused_pieces_leave_the_local_run_as_it_was(tmp_path, model_dir):
    pieces = tmp_path / "pieces"
    run_regenerate(_limit(_recipe(tmp_path, model_dir, "a", temperature=0.5), 2), progress=False, pieces=pieces)
    mine = _recipe(tmp_path, model_dir, "mine", temperature=0.8)
    run_regenerate(_limit(mine, 2), progress=False)
    run_regenerate(mine, resume=True, progress=False, minutes=1e-9)  # grown, stopped: an unfinished run
    local = sorted((p.name, p.read_bytes()) for p in (tmp_path / "mine").iterdir())
    with pytest.raises(DataError, match="--pieces.*temperature"):
        run_regenerate(mine, progress=False, pieces=pieces)
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "pieces", broken)
    (broken / "run.json").write_text((tmp_path / "mine" / "regenerated.jsonl.run.json").read_text())
    (broken / "part-0002.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="part-0002.jsonl.gz: cannot be read"):
        run_regenerate(mine, progress=False, pieces=broken)
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "mine").iterdir()) == local


def test_append_missing_cuts_a_torn_line_even_when_nothing_is_added(tmp_path):
    from headstart.precompute.pieces import append_missing

    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a"}\n{"id": "b", "conversations": [{"from": "hu')
    assert append_missing(f, [("a", '{"id": "a"}')]) == 0
    assert f.read_text() == '{"id": "a"}\n'


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_only_a_greedy_run_goes_on_with_another_engine(tmp_path, model_dir, capsys, temperature):
    """Pieces and a local run whose records say vLLM made them: a greedy run goes on with ours, says so once
    every record is checked, and its records then name ours; a sampled one is refused, the samplers differ.
    Real vLLM rows: test_vllm.py."""
    def as_vllm(record):
        record.write_text(json.dumps({**json.loads(record.read_text()), "engine": "vllm"}))

    pieces = tmp_path / "pieces"
    run_regenerate(_limit(_recipe(tmp_path, model_dir, "v", temperature=temperature), 3), progress=False,
                   pieces=pieces)
    as_vllm(pieces / "run.json")
    local = _limit(_recipe(tmp_path, model_dir, "l", temperature=temperature), 6)
    run_regenerate(local, progress=False, minutes=1e-9)  # an unfinished local run at the same limit
    as_vllm(record := tmp_path / "l" / "regenerated.jsonl.run.json")
    capsys.readouterr()
    if temperature:
        for where in ({"pieces": pieces}, {"resume": True}):
            with pytest.raises(DataError, match="different engine"):
                run_regenerate(local, progress=True, **where)
        assert "goes on" not in capsys.readouterr().err and json.loads(record.read_text())["engine"] == "vllm"
        return
    out = run_regenerate(local, resume=True, progress=True, minutes=60)
    assert "l/regenerated.jsonl.partial was made with engine vllm; greedy, so it goes on with headstart" in \
        capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 6 and "engine" not in json.loads(record.read_text())
    out = run_regenerate(_recipe(tmp_path, model_dir, "h", temperature=temperature), progress=True, pieces=pieces)
    assert capsys.readouterr().err.count("made with engine vllm; greedy, so it goes on with headstart") == 1
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [f"c{i}" for i in range(9)]
    assert "engine" not in json.loads((pieces / "run.json").read_text())  # the record names the last engine


def test_a_restore_that_adds_nothing_leaves_the_pieces_record_as_it_was(tmp_path, model_dir):
    """Finished pieces that vLLM made, restored on a new machine by our engine (greedy): nothing is decoded, so
    the committed record still names the engine that made every row."""
    pieces = tmp_path / "pieces"
    run_regenerate(_limit(_recipe(tmp_path, model_dir, "v"), 3), progress=False, pieces=pieces)
    record = pieces / "run.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "engine": "vllm"}))
    before = record.read_bytes()
    out = run_regenerate(_limit(_recipe(tmp_path, model_dir, "new"), 3), progress=False, pieces=pieces)
    assert len(out.read_text().splitlines()) == 3 and record.read_bytes() == before


# save() alone: the pieces' record after a save (no model needed)

def _record(path, **kw):
    path.write_text(json.dumps({"model": "m", "temperature": 0.0, "limit": 3, **kw}))
    return path


def _rows(path, n):
    path.write_text("".join(json.dumps({"id": f"c{i}"}) + "\n" for i in range(n)))
    return path


def _finished(tmp_path, n=3, **kw):
    """Pieces of a finished limit-n run: the record and one piece of c0..c(n-1)."""
    pieces = tmp_path / "pieces"
    save(pieces, _rows(tmp_path / "rows0", n), _record(tmp_path / "rec0", limit=n, **kw))
    return pieces


def test_a_grown_limit_with_nothing_new_updates_the_limit_and_keeps_the_engine(tmp_path):
    pieces = _finished(tmp_path, engine="vllm")
    assert save(pieces, _rows(tmp_path / "rows", 3), _record(tmp_path / "rec", limit=None)) is None
    assert json.loads((pieces / "run.json").read_text()) == {"model": "m", "temperature": 0.0, "limit": None,
                                                             "engine": "vllm"}


@pytest.mark.parametrize("pieces_engine, run_engine", [("vllm", None), (None, "vllm")])
def test_an_engine_only_difference_with_nothing_new_leaves_the_record(tmp_path, pieces_engine, run_engine):
    pieces = _finished(tmp_path, **({"engine": pieces_engine} if pieces_engine else {}))
    before = (pieces / "run.json").read_bytes()
    assert save(pieces, _rows(tmp_path / "rows", 3),
                _record(tmp_path / "rec", **({"engine": run_engine} if run_engine else {}))) is None
    assert (pieces / "run.json").read_bytes() == before


def test_new_rows_at_the_same_limit_make_the_record_name_their_engine(tmp_path):
    pieces = tmp_path / "pieces"
    save(pieces, _rows(tmp_path / "rows0", 3), _record(tmp_path / "rec0", limit=5, engine="vllm"))
    assert save(pieces, _rows(tmp_path / "rows", 5), _record(tmp_path / "rec", limit=5)) is not None
    assert "engine" not in json.loads((pieces / "run.json").read_text())


@pytest.mark.parametrize("text", ["{", "[1, 2]"])
def test_an_unreadable_pieces_record_is_replaced_at_the_end_of_a_run(tmp_path, text):
    pieces = _finished(tmp_path)
    (pieces / "run.json").write_text(text)
    rec = _record(tmp_path / "rec")
    assert save(pieces, _rows(tmp_path / "rows", 3), rec) is None
    assert json.loads((pieces / "run.json").read_text()) == json.loads(rec.read_text())


def test_a_kill_between_the_two_writes_leaves_no_row_beyond_the_records_limit(tmp_path, monkeypatch):
    import headstart.precompute.pieces as pieces_module

    pieces = _finished(tmp_path)
    real, calls = pieces_module.atomic_path, []

    def second_write_killed(final, **kw):
        calls.append(final.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(final, **kw)

    monkeypatch.setattr(pieces_module, "atomic_path", second_write_killed)
    with pytest.raises(KeyboardInterrupt):
        pieces_module.save(pieces, _rows(tmp_path / "rows", 5), _record(tmp_path / "rec", limit=5))
    held = [json.loads(x)["id"] for p in pieces_module._parts(pieces)
            for x in gzip.open(p, "rt", encoding="utf-8").read().splitlines()]
    assert len(set(held)) <= json.loads((pieces / "run.json").read_text())["limit"]
