import json

import pytest
from conftest import write_jsonl

from headstart.data.sources import ROLE_ALIASES, read_conversations, read_prompts
from headstart.errors import DataError

U = {"from": "human", "value": "hi"}
A = {"from": "gpt", "value": "hello"}


def test_sharegpt_json_array_and_aliases(tmp_path):
    rows = [
        {"id": "a", "conversations": [{"from": "system", "value": "be nice"}, U, A]},
        {"id": "b", "conversations": [{"from": "User", "value": "q"}, {"from": "chatgpt", "value": "r"},
                                      {"from": "human", "value": "trailing question, no reply"}]},
        {"conversations": [{"from": "prompter", "value": "q"}, {"from": "bard", "value": "r"}]},
    ]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(rows))
    out = read_conversations(p)
    assert out.rows == 3 and not out.skipped
    a, b, c = out.conversations
    assert [m["role"] for m in a["messages"]] == ["system", "user", "assistant"]
    assert [m["role"] for m in b["messages"]] == ["user", "assistant"]  # trailing user turn dropped
    assert c["id"] == "sg-2"  # rows without an id get file-stem + row


def test_openai_messages_jsonl(tmp_path):
    p = write_jsonl(tmp_path / "m.jsonl", [
        {"id": 7, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
    ])
    out = read_conversations(p)
    assert out.conversations[0] == {
        "id": "7", "category": None,
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
    }


def test_every_alias_maps_to_a_known_role():
    assert set(ROLE_ALIASES.values()) == {"system", "user", "assistant"}


@pytest.mark.parametrize(
    ("row", "reason", "key"),
    [
        ({"conversations": [{"value": "no role"}, A]}, "missing_role", "conversations[0].from"),
        ({"conversations": [{"from": "wizard", "value": "x"}, A]}, "unknown_role", "conversations[0].from='wizard'"),
        ({"conversations": [U, {"from": "gpt", "value": "   "}]}, "empty_content", "conversations[1].value"),
        ({"conversations": [U, {"from": "gpt", "value": 42}]}, "non_string_content", "conversations[1].value"),
        ({"conversations": [U, {"from": "gpt"}]}, "non_string_content", "conversations[1].value"),
        ({"conversations": [U, {"from": "human", "value": "again"}]}, "no_assistant_turn", "conversations"),
        ({"conversations": [A]}, "starts_with_assistant", "conversations[0]"),
        ({"conversations": []}, "no_turns", "conversations"),
        ({"text": "no turns at all"}, "no_turns", "messages"),
        ({"conversations": ["just a string"]}, "not_an_object", "conversations[0]"),
        (["not", "an", "object"], "not_an_object", ""),
        ({"messages": [{"role": "tool", "content": "x"}]}, "unknown_role", "messages[0].role='tool'"),
    ],
)
def test_bad_rows_are_skipped_by_reason_with_location(tmp_path, row, reason, key):
    good = {"id": "g", "conversations": [U, A]}
    p = write_jsonl(tmp_path / "d.jsonl", [good, row])
    out = read_conversations(p)
    assert [c["id"] for c in out.conversations] == ["g"]
    assert dict(out.skipped) == {reason: 1}
    where = out.examples[reason][0]
    assert where.startswith("d.jsonl:line 2")
    if key:
        assert f"key '{key}'" in where


def test_leading_assistant_turns_are_dropped_and_counted(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [A, U, A]}])
    out = read_conversations(p)
    assert [m["role"] for m in out.conversations[0]["messages"]] == ["user", "assistant"]
    assert dict(out.repaired) == {"dropped_leading_assistant_turns": 1} and not out.skipped


def test_truncated_jsonl_last_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"conversations": [U, A]}) + "\n" + '{"conversations": [{"from": "hu')
    out = read_conversations(p)
    assert len(out.conversations) == 1
    assert dict(out.skipped) == {"invalid_json": 1} and "t.jsonl:line 2" in out.examples["invalid_json"][0]


def test_truncated_json_array_is_salvaged_and_reported(tmp_path):
    text = json.dumps([{"conversations": [U, A]}] * 3)
    p = tmp_path / "t.json"
    p.write_text(text[:-30])
    out = read_conversations(p)
    assert len(out.conversations) == 2 and out.unparsed_tail_bytes > 0


def test_non_utf8_file_is_an_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_bytes(b'[{"conversations": [{"from": "human", "value": "\xff"}]}]')
    with pytest.raises(DataError, match="bad.json: not UTF-8"):
        read_conversations(p)


def test_empty_file_and_missing_file(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    with pytest.raises(DataError, match="holds no rows"):
        read_conversations(p)
    with pytest.raises(DataError, match="not found"):
        read_conversations(tmp_path / "missing.jsonl")
    p = tmp_path / "empty.json"
    p.write_text("[]")
    with pytest.raises(DataError, match="holds no rows"):
        read_conversations(p)


def test_limit_counts_rows(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [U, A]}] * 10)
    out = read_conversations(p, limit=4)
    assert out.rows == 4 and len(out.conversations) == 4


def test_prompts(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Write a haiku", "id": "h", "category": "writing"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "old answer"}]},
        {"prompt": ""},
        {"prompt": ["x"]},
        {"messages": [{"role": "assistant", "content": "only"}]},
    ])
    out = read_prompts(p)
    assert out.conversations[0] == {"id": "h", "category": "writing",
                                    "messages": [{"role": "user", "content": "Write a haiku"}]}
    assert [m["role"] for m in out.conversations[1]["messages"]] == ["system", "user"]
    assert dict(out.skipped) == {"empty_content": 1, "non_string_content": 1, "no_user_turn": 1}
    with pytest.raises(DataError, match="prompt files are JSONL"):
        read_prompts(tmp_path / "p.json")
