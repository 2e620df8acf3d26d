import pytest
from conftest import write_jsonl

import headstart.data.dataset as dataset_mod
from headstart.config import DataConfig
from headstart.data.dataset import build_dataset, is_heldout, load_tokenizer
from headstart.data.template import ChatRenderer
from headstart.errors import DataError


def _rows(n):
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question {i}: what is {i} + {i}?"},
                 {"from": "gpt", "value": f"The answer is {2 * i}."}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "Because of addition. " * (i % 7)}]
        rows.append({"id": f"c{i}", "conversations": turns})
    rows[5] = {"id": "bad-role", "conversations": [{"from": "alien", "value": "x"}]}
    rows[9] = "{not json"
    return rows


@pytest.fixture
def source(tmp_path):
    return write_jsonl(tmp_path / "convs.jsonl", _rows(60))


def test_build_counts_masks_and_split(source, tiny_model_dir):
    cfg = DataConfig(source=str(source), max_length=64, heldout_fraction=0.25)
    built = build_dataset(cfg, str(tiny_model_dir), progress=False)
    s = built.stats
    assert s.rows_read == 60 and s.conversations + sum(s.skipped.values()) == 60
    assert s.skipped["unknown_role"] == 1 and s.skipped["invalid_json"] == 1
    assert s.train_conversations + s.heldout_conversations == s.conversations
    assert 0 < s.heldout_conversations < s.conversations
    assert s.tokens == s.train_tokens + s.heldout_tokens
    assert s.truncated > 0  # the long multi-turn rows exceed 64 tokens
    renderer = ChatRenderer(load_tokenizer(tiny_model_dir))
    total_sup = 0
    for ds, held in ((built.train, False), (built.heldout, True)):
        for row in ds:
            assert is_heldout(row["id"], 0.25) == held
            i = int(row["id"][1:])
            conv = _rows(60)[i]["conversations"]
            msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in conv]
            r = renderer.render(msgs, 64)
            assert row["input_ids"] == r.input_ids and row["loss_mask"] == r.loss_mask
            assert row["num_supervised"] == sum(r.loss_mask) > 0
            total_sup += row["num_supervised"]
    assert total_sup == s.supervised_tokens
    assert set(built.train["id"]).isdisjoint(built.heldout["id"])


def test_second_build_comes_from_the_cache(source, tiny_model_dir, monkeypatch):
    cfg = DataConfig(source=str(source), max_length=64)
    first = build_dataset(cfg, str(tiny_model_dir), progress=False)

    def boom(*a, **k):
        raise AssertionError("re-processed instead of using the cache")

    monkeypatch.setattr(dataset_mod, "_process", boom)
    second = build_dataset(cfg, str(tiny_model_dir), progress=False)
    assert second.fingerprint == first.fingerprint and second.stats == first.stats
    with pytest.raises(AssertionError, match="re-processed"):  # a different max_length is a new entry
        build_dataset(DataConfig(source=str(source), max_length=65), str(tiny_model_dir), progress=False)


def test_split_is_by_id_not_by_order_or_limit(source, tiny_model_dir):
    full = build_dataset(DataConfig(source=str(source), heldout_fraction=0.3), str(tiny_model_dir), progress=False)
    part = build_dataset(DataConfig(source=str(source), heldout_fraction=0.3, limit=30), str(tiny_model_dir),
                         progress=False)
    assert part.stats.rows_read == 30
    assert set(part.heldout["id"]) <= set(full.heldout["id"])
    assert set(part.train["id"]) <= set(full.train["id"])


def test_worker_processes_give_the_same_result(source, tiny_model_dir, tmp_path, monkeypatch):
    one = build_dataset(DataConfig(source=str(source), num_proc=1), str(tiny_model_dir), progress=False)
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "other-cache"))
    two = build_dataset(DataConfig(source=str(source), num_proc=2), str(tiny_model_dir), progress=False)
    assert one.train["input_ids"] == two.train["input_ids"]
    assert one.train["loss_mask"] == two.train["loss_mask"]
    assert one.stats == two.stats


def test_zero_supervised_tokens_is_an_error(source, tiny_model_dir):
    # 12 tokens hold the system prompt and the question, never a reply.
    with pytest.raises(DataError, match="zero supervised") as e:
        build_dataset(DataConfig(source=str(source), max_length=12), str(tiny_model_dir), progress=False)
    assert "no_supervised_tokens_within_max_length" in str(e.value)


def test_no_usable_conversation_is_an_error(tmp_path, tiny_model_dir):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "gpt", "value": "x"}]}, {"x": 1}])
    with pytest.raises(DataError, match="none of the 2 rows") as e:
        build_dataset(DataConfig(source=str(p)), str(tiny_model_dir), progress=False)
    assert "starts_with_assistant" in str(e.value) and "bad.jsonl:line 1" in str(e.value)


def test_template_failures_are_counted_not_fatal(tmp_path, tiny_model_dir):
    d = tmp_path / "gemma-like"
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tok.save_pretrained(d)
    (d / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                           {"from": "gpt", "value": "a"}]},
    ])
    built = build_dataset(DataConfig(source=str(p), heldout_fraction=0.0), str(d), progress=False)
    assert built.stats.conversations == 1 and built.stats.skipped == {"template_error": 1}


def test_split_by_id_prefix_keeps_chunks_together(tmp_path, tiny_model_dir):
    from headstart.data.dataset import split_key

    assert split_key("QWJhYvA_12", "id_prefix") == "QWJhYvA" and split_key("QWJhYvA_12") == "QWJhYvA_12"
    assert split_key("no_suffix_x", "id_prefix") == "no_suffix_x" and split_key("_3", "id_prefix") == "_3"
    rows = [{"id": f"chat{c}_{k}", "conversations": [{"from": "human", "value": f"q {c} {k}"},
                                                     {"from": "gpt", "value": "a"}]}
            for c in range(12) for k in range(3)]
    src = write_jsonl(tmp_path / "chunks.jsonl", rows)
    built = build_dataset(DataConfig(source=str(src), heldout_fraction=0.4, split_key="id_prefix"),
                          str(tiny_model_dir), progress=False)
    held = {i.rsplit("_", 1)[0] for i in built.heldout["id"]}
    train = {i.rsplit("_", 1)[0] for i in built.train["id"]}
    assert held and train and held.isdisjoint(train)
    assert len(built.heldout) == 3 * len(held)


def test_a_damaged_cache_entry_is_rebuilt(tmp_path, tiny_model_dir):
    import json

    from headstart.assets import cache_dir
    from headstart.config import DataConfig
    from headstart.data.dataset import build_dataset

    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"hi {i}"},
                                              {"from": "gpt", "value": "hello there"}]} for i in range(20)]
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = DataConfig(source=str(src), max_length=64, heldout_fraction=0.0)
    first = build_dataset(cfg, str(tiny_model_dir), progress=False)
    first_ids, first_tokens = [list(x) for x in first.train["input_ids"]], first.stats.tokens
    (entry,) = (cache_dir() / "datasets").iterdir()
    arrow = next((entry / "processed").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:100])
    again = build_dataset(cfg, str(tiny_model_dir), progress=False)
    assert [list(x) for x in again.train["input_ids"]] == first_ids
    (entry / "stats.json").write_text("[not stats")
    assert build_dataset(cfg, str(tiny_model_dir), progress=False).stats.tokens == first_tokens


def test_max_turns_keeps_each_conversation_up_to_its_nth_reply(source, tiny_model_dir):
    renderer = ChatRenderer(load_tokenizer(tiny_model_dir))
    full = build_dataset(DataConfig(source=str(source), max_length=256), str(tiny_model_dir), progress=False)
    first = build_dataset(DataConfig(source=str(source), max_length=256, max_turns=1), str(tiny_model_dir),
                          progress=False)
    two = build_dataset(DataConfig(source=str(source), max_length=256, max_turns=2), str(tiny_model_dir),
                        progress=False)
    assert first.fingerprint != full.fingerprint
    assert set(first.train["id"]) == set(full.train["id"])  # same conversations, same split
    by_id = {r["id"]: r for r in full.train}
    cut = 0
    for row in first.train:
        conv = _rows(60)[int(row["id"][1:])]["conversations"][:2]
        msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in conv]
        r = renderer.render(msgs, 256)
        assert row["input_ids"] == r.input_ids and row["loss_mask"] == r.loss_mask
        # the first reply is a prefix of the full conversation's rendering
        assert by_id[row["id"]]["input_ids"][: len(r.input_ids)] == r.input_ids
        cut += row["num_tokens"] < by_id[row["id"]]["num_tokens"]
    assert cut > 0  # the two-reply rows were cut
    assert [r["input_ids"] for r in two.train] == [r["input_ids"] for r in full.train]  # none has three replies
    assert first.stats.supervised_tokens < full.stats.supervised_tokens


@pytest.mark.parametrize("value", [0, -1, True, "2", 1.0])
def test_max_turns_bad_values_name_the_key(value):
    from headstart.errors import ConfigError
    from headstart.recipe_io import recipe_from_dict

    with pytest.raises(ConfigError, match="data.max_turns"):
        recipe_from_dict({"data": {"max_turns": value}})


def test_max_turns_null_keeps_the_fingerprint_earlier_caches_have(source, tiny_model_dir):
    """Earlier dataset caches and precompute runs name their data by this fingerprint: max_turns null must not
    move it (its key is there only when set)."""
    import hashlib
    import json

    from headstart.data.dataset import _fingerprint, content_sha256, sha256_file

    cfg, tok = DataConfig(source=str(source)), load_tokenizer(tiny_model_dir)
    before = {"format": dataset_mod._FORMAT, "content_sha256": content_sha256(source), "data_format": cfg.format,
              "limit": cfg.limit, "max_length": cfg.max_length,
              "tokenizer": sha256_file(tiny_model_dir / "tokenizer.json"), "template": tok.chat_template}
    expected = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:20]
    assert _fingerprint(source, cfg, tiny_model_dir, tok) == expected
    assert _fingerprint(source, DataConfig(source=str(source), max_turns=1), tiny_model_dir, tok) != expected
