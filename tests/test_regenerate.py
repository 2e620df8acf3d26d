"""Regeneration: assistant turns rewritten by the target through the engine, user turns kept,
provenance recorded; an interrupted run resumes to exactly what an uninterrupted one writes."""

import json

import pytest
from conftest import write_jsonl

from headstart.errors import DataError
from headstart.precompute.regenerate import run_regenerate
from headstart.recipe_io import load_recipe


@pytest.fixture
def model_dir(chat_model_dir):
    return chat_model_dir


def _recipe(tmp_path, model_dir, name, temperature=0.0):
    rows = [{"id": f"c{i}", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "old answer"},
        {"from": "human", "value": "and then?"}, {"from": "gpt", "value": "old answer two"}]} for i in range(9)]
    rows.append({"id": "bad", "conversations": [{"from": "gpt", "value": "orphan"}]})
    src = write_jsonl(tmp_path / "src.jsonl", rows)
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"output_dir: {tmp_path / name}\ntarget:\n  model: {model_dir}\n  dtype: fp32\n"
                 f"data:\n  source: {src}\nregenerate:\n  max_tokens: 6\n  batch_size: 2\n"
                 f"  temperature: {temperature}\n")
    return load_recipe(p)


def test_regenerate_rewrites_assistant_turns(tmp_path, model_dir):
    out = run_regenerate(_recipe(tmp_path, model_dir, "a"), progress=False)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 9  # the orphan reply was skipped by the data layer
    for r in rows:
        roles = [t["from"] for t in r["conversations"]]
        assert roles == ["system", "human", "gpt", "human", "gpt"]
        assert r["conversations"][3]["value"] == "and then?"
        assert all(t["value"] != "old answer" for t in r["conversations"] if t["from"] == "gpt")
        assert r["regenerated"]["max_tokens"] == 6 and len(r["regenerated"]["finish_reasons"]) == 2
    with pytest.raises(DataError, match="already exists"):
        run_regenerate(_recipe(tmp_path, model_dir, "a"), progress=False)


def test_interrupted_regeneration_resumes_exactly(tmp_path, model_dir):
    full = run_regenerate(_recipe(tmp_path, model_dir, "full", temperature=0.8), progress=False).read_text()
    recipe = _recipe(tmp_path, model_dir, "part", temperature=0.8)
    out = run_regenerate(recipe, progress=False)
    lines = out.read_text().splitlines(keepends=True)
    # Simulate a kill: the output was never renamed, and its last line was torn mid-write.
    out.unlink()
    partial = out.with_name(out.name + ".partial")
    partial.write_text("".join(lines[:4]) + lines[4][:10])
    with pytest.raises(DataError, match="pass --resume"):
        run_regenerate(recipe, progress=False)
    out = run_regenerate(recipe, resume=True, progress=False)
    assert out.read_text() == full


def test_an_unwritable_output_is_refused_before_decoding(tmp_path, model_dir, monkeypatch):
    import dataclasses

    recipe = _recipe(tmp_path, model_dir, "ro")
    recipe = dataclasses.replace(recipe, regenerate=dataclasses.replace(recipe.regenerate,
                                                                          output="/proc/headstart/out.jsonl"))
    loaded = []
    import headstart.inference as inference

    monkeypatch.setattr(inference, "Engine", lambda *a, **k: loaded.append(1))
    with pytest.raises(DataError, match="cannot be written"):
        run_regenerate(recipe, progress=False)
    assert not loaded


def test_max_turns_source_and_limit(tmp_path, model_dir):
    """regenerate.source / limit pick what is rewritten (data.source may then name the output, so one
    recipe regenerates and trains); max_turns keeps each conversation up to its N-th reply."""
    import dataclasses

    recipe = _recipe(tmp_path, model_dir, "turns")
    src = recipe.data.source
    out = tmp_path / "turns" / "regenerated.jsonl"
    recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, source=str(out)),
                                 regenerate=dataclasses.replace(recipe.regenerate, source=src, limit=4, max_turns=1))
    rows = [json.loads(x) for x in run_regenerate(recipe, progress=False).read_text().splitlines()]
    assert [r["id"] for r in rows] == ["c0", "c1", "c2", "c3"]
    for r in rows:
        assert [t["from"] for t in r["conversations"]] == ["system", "human", "gpt"]
        assert r["regenerated"]["max_turns"] == 1 and len(r["regenerated"]["finish_reasons"]) == 1
    same = dataclasses.replace(recipe, regenerate=dataclasses.replace(recipe.regenerate, source=None,
                                                                        output=str(tmp_path / "x.jsonl")))
    same = dataclasses.replace(same, data=dataclasses.replace(same.data, source=str(tmp_path / "x.jsonl")))
    with pytest.raises(DataError, match="is the output"):
        run_regenerate(same, progress=False)


def test_resume_reads_lines_with_unicode_line_separators(tmp_path):
    """Written with ensure_ascii=False, a reply holding U+2028 / U+0085 stays one JSONL line: the ids
    already done are read line by line on "\\n" only (str.splitlines would cut the line in two)."""
    from headstart.precompute.regenerate import _done_ids

    partial = tmp_path / "out.jsonl.partial"
    rows = [{"id": "a", "text": "one\u2028two\u0085three"}, {"id": "b", "text": "x"}]
    partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + '{"id": "c", "te',
                       encoding="utf-8")
    assert _done_ids(partial) == {"a", "b"}
    assert partial.read_text(encoding="utf-8").endswith('"x"}\n')  # the torn line was cut off


def test_max_prompt_tokens_skips_long_prompts(tmp_path, model_dir):
    import dataclasses

    recipe = _recipe(tmp_path, model_dir, "short")
    first = run_regenerate(recipe, progress=False)
    n_all = len(first.read_text().splitlines())
    lengths = []
    from headstart.inference import Engine

    eng = Engine(str(model_dir), dtype="fp32")
    for row in (json.loads(x) for x in first.read_text().splitlines()):
        turns = [{"role": {"system": "system", "human": "user"}[t["from"]], "content": t["value"]}
                 for t in row["conversations"][:2]]
        lengths.append(len(eng.encode(turns)))
    for cut, expect in ((max(lengths), n_all), (min(lengths) - 1, 0)):
        short = dataclasses.replace(recipe, output_dir=str(tmp_path / f"short-{cut}"),
                                    regenerate=dataclasses.replace(recipe.regenerate, max_prompt_tokens=cut))
        kept = run_regenerate(short, progress=False).read_text().splitlines()
        assert len(kept) == expect == sum(n <= cut for n in lengths)


def test_a_finished_run_grows_with_a_larger_limit(tmp_path, model_dir):
    """Raising regenerate.limit and passing --resume adds the next source rows to a finished output:
    the same conversations, in the same order, as one run with the larger limit; a smaller or equal
    limit, or no --resume, is refused and leaves the output as it was."""
    import dataclasses

    def with_limit(recipe, n):
        return dataclasses.replace(recipe, regenerate=dataclasses.replace(recipe.regenerate, limit=n))

    one = run_regenerate(with_limit(_recipe(tmp_path, model_dir, "one", temperature=0.8), 7), progress=False)
    recipe = _recipe(tmp_path, model_dir, "grown", temperature=0.8)
    out = run_regenerate(with_limit(recipe, 3), progress=False)
    first = out.read_text()
    for n, resume in ((7, False), (3, True), (2, True)):
        with pytest.raises(DataError, match="already exists"):
            run_regenerate(with_limit(recipe, n), resume=resume, progress=False)
        assert out.read_text() == first
    hotter = _recipe(tmp_path, model_dir, "grown", temperature=0.5)  # same output, other provenance
    with pytest.raises(DataError, match="different temperature"):
        run_regenerate(with_limit(hotter, 7), resume=True, progress=False)
    assert out.read_text() == first and not out.with_name(out.name + ".partial").read_text()
    out = run_regenerate(with_limit(recipe, 7), resume=True, progress=False)
    got = [json.loads(x) for x in out.read_text().split("\n")[:-1]]
    want = [json.loads(x) for x in one.read_text().split("\n")[:-1]]
    assert [r["id"] for r in got] == [r["id"] for r in want] == [f"c{i}" for i in range(7)]
    assert [r["conversations"] for r in got] == [r["conversations"] for r in want]
    assert out.read_text().startswith(first)
    assert [r["regenerated"]["limit"] for r in got] == [3] * 3 + [7] * 4
    run_file = out.with_name(out.name + ".run.json")
    assert json.loads(run_file.read_text())["limit"] == 7


def test_max_context_tokens_stops_a_conversation_where_its_context_would_be_cut(tmp_path, model_dir):
    """A later turn whose prompt reaches max_context_tokens is not decoded (training would cut it at
    data.max_length), the turns before it are kept; the first turn is always regenerated."""
    import dataclasses

    recipe = _recipe(tmp_path, model_dir, "ctx")
    for cut, replies in ((1, 1), (100_000, 2)):
        r = dataclasses.replace(recipe, output_dir=str(tmp_path / f"ctx-{cut}"),
                                regenerate=dataclasses.replace(recipe.regenerate, max_context_tokens=cut))
        rows = [json.loads(x) for x in run_regenerate(r, progress=False).read_text().splitlines()]
        assert len(rows) == 9
        for row in rows:
            roles = ["system", "human", "gpt", "human", "gpt"][:1 + 2 * replies]
            assert [t["from"] for t in row["conversations"]] == roles
            assert row["regenerated"]["max_context_tokens"] == cut
            assert len(row["regenerated"]["finish_reasons"]) == replies


def test_a_users_file_or_directory_at_the_output_is_refused_without_advice_that_cannot_work(tmp_path, model_dir):
    """Growing by --resume and a larger limit applies to an earlier regenerate output only: a user's file
    (or a directory) there is named as not ours, with or without --resume, and left as it was."""
    import dataclasses

    recipe = _recipe(tmp_path, model_dir, "user")
    user_file = tmp_path / "mine.jsonl"
    user_file.write_text('{"hello": 1}\n')
    (tmp_path / "mydir").mkdir()
    for target in (user_file, tmp_path / "mydir"):
        r = dataclasses.replace(recipe, regenerate=dataclasses.replace(recipe.regenerate, output=str(target)))
        for resume in (False, True):
            with pytest.raises(DataError, match="is not a regenerate output.*set regenerate.output to a new file"):
                run_regenerate(r, resume=resume, progress=False)
    assert user_file.read_text() == '{"hello": 1}\n' and not list((tmp_path / "mydir").iterdir())


def test_max_context_tokens_stops_exactly_at_a_prompt_of_that_length(tmp_path, model_dir):
    """The boundary: a second turn whose prompt is exactly max_context_tokens long is not decoded; one token
    more of room and it is."""
    import dataclasses

    from headstart.inference import Engine

    recipe = _recipe(tmp_path, model_dir, "edge")
    full = dataclasses.replace(recipe, output_dir=str(tmp_path / "edge-all"))
    row = json.loads(run_regenerate(full, progress=False).read_text().splitlines()[0])
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    turns = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"][:4]]
    second = len(Engine(str(model_dir), dtype="fp32").encode(turns))  # the second turn's prompt
    for cut, replies in ((second, 1), (second + 1, 2)):
        r = dataclasses.replace(recipe, output_dir=str(tmp_path / f"edge-{cut}"),
                                regenerate=dataclasses.replace(recipe.regenerate, max_context_tokens=cut))
        got = json.loads(run_regenerate(r, progress=False).read_text().splitlines()[0])
        assert got["id"] == row["id"] and len(got["regenerated"]["finish_reasons"]) == replies, (cut, second)


def test_a_run_killed_mid_way_keeps_every_conversation_that_finished(tmp_path, model_dir, monkeypatch):
    """Each conversation reaches the partial file the moment its last reply is in (not at the end of a
    chunk of batch_size x 4), so a kill loses only the conversations in flight; the resumed run writes
    the rows in source order, with the same text as an uninterrupted one, and counts its tokens."""
    from headstart.inference import Engine

    full = run_regenerate(_recipe(tmp_path, model_dir, "full", temperature=0.8), progress=False).read_text()
    recipe = _recipe(tmp_path, model_dir, "killed", temperature=0.8)
    step, steps = Engine.step, []

    def killed_after_20_steps(self):
        steps.append(1)
        if len(steps) > 20:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Engine, "step", killed_after_20_steps)
    with pytest.raises(KeyboardInterrupt):
        run_regenerate(recipe, progress=False)
    monkeypatch.setattr(Engine, "step", step)
    partial = tmp_path / "killed" / "regenerated.jsonl.partial"
    kept = [json.loads(x)["id"] for x in partial.read_text().splitlines()]
    assert 2 <= len(kept) < 9  # 20 steps of 6 tokens at batch 2 finish a few two-turn conversations
    out = run_regenerate(recipe, resume=True, progress=False)
    assert out.read_text() == full and not partial.exists()
    rows = [json.loads(x) for x in full.splitlines()]
    assert [r["id"] for r in rows] == [f"c{i}" for i in range(9)]
    assert all(len(r["regenerated"]["tokens"]) == 2 and 1 <= min(r["regenerated"]["tokens"]) for r in rows)


def test_later_turns_take_their_history_from_the_prefix_cache(tmp_path, model_dir, capsys):
    """Turn 2's prompt starts with turn 1's prompt and answer: with regenerate.prefix_cache (the default)
    those pages are not prefilled again; without it every prompt token is."""
    import dataclasses
    import re

    def reused(name: str, on: bool) -> tuple[int, int]:
        recipe = _recipe(tmp_path, model_dir, name)
        recipe = dataclasses.replace(recipe, regenerate=dataclasses.replace(recipe.regenerate, prefix_cache=on))
        run_regenerate(recipe, progress=True)
        line = [x for x in capsys.readouterr().err.splitlines() if "prefix cache" in x][-1]
        prefilled, cached = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) (?:prompt tokens|taken)", line))
        return prefilled, cached

    on, off = reused("on", True), reused("off", False)
    assert on[1] > 0 and off[1] == 0
    assert on[0] < off[0]
