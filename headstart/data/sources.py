"""Conversation sources: ShareGPT JSON/JSONL, OpenAI-style `messages` JSONL, plain prompt JSONL.

Every row is normalised to `{"id", "messages": [{"role", "content"}], "category"}` with roles
`system` / `user` / `assistant`, or skipped with a stable reason that is counted and reported with
the first few locations (file, row, key). Nothing here raises on a bad row; a file that cannot be
read at all (not UTF-8, not JSON) and a source with no rows are errors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headstart.errors import DataError
from headstart.fileio import iter_jsonl, read_json_array

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "bot": "assistant",
}

MAX_EXAMPLES_PER_REASON = 3


@dataclass
class SourceRead:
    """What a source file turned into."""

    path: Path
    rows: int = 0  # rows looked at (after `limit`)
    conversations: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first locations
    repaired: Counter = field(default_factory=Counter)  # kept rows that were fixed up, by repair
    # A cut-off JSON array is not fatal (the embedded ShareGPT file is one): its complete rows are
    # kept and the bytes of the unparsable tail are reported.
    unparsed_tail_bytes: int = 0

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < MAX_EXAMPLES_PER_REASON:
            shown.append(where)


class _Skip(Exception):
    def __init__(self, reason: str, key: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.key = key


def read_conversations(
    path: str | Path, fmt: str = "auto", limit: int | None = None, for_prompts: bool = False
) -> SourceRead:
    """Read a .json array or a .jsonl file of conversations.

    With `for_prompts`, rows are prompts to complete: each must end on a user turn (trailing
    assistant turns are dropped) instead of holding an assistant reply to learn from.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data source not found: {path}")
    out = SourceRead(path)
    for row, record, error in _rows(path, out):
        if limit is not None and out.rows >= limit:
            break
        out.rows += 1
        where = f"{path.name}:{'line' if path.suffix == '.jsonl' else 'row'} {row}"
        if error is not None:
            out.skip("invalid_json", f"{where} ({error})")
            continue
        try:
            repairs: list[str] = []
            out.conversations.append(normalise(record, fmt, f"{path.stem}-{row}", for_prompts, repairs))
            out.repaired.update(repairs)
        except _Skip as s:
            out.skip(s.reason, f"{where}" + (f" (key '{s.key}')" if s.key else ""))
    if out.rows == 0:
        raise DataError(f"{path}: holds no rows; expected conversations (ShareGPT or OpenAI messages)")
    return out


def _rows(path: Path, out: SourceRead):
    if path.suffix == ".jsonl":
        yield from iter_jsonl(path)
        return
    read = read_json_array(path)
    out.unparsed_tail_bytes = read.bytes_unparsed
    for i, record in enumerate(read.records):
        yield i, record, None


def normalise(
    record: Any, fmt: str = "auto", default_id: str = "", for_prompts: bool = False,
    repairs: list[str] | None = None,
) -> dict[str, Any]:
    """One row -> {"id", "messages", "category"}; raises _Skip(reason, key) for a bad row.

    Repairs made to a kept row (e.g. dropped leading assistant turns) are appended to `repairs`.
    """
    repairs = [] if repairs is None else repairs
    if not isinstance(record, dict):
        raise _Skip("not_an_object")
    rid = record.get("id", default_id)
    cid = str(rid) if isinstance(rid, (str, int)) and str(rid) else default_id
    category = record.get("category") if isinstance(record.get("category"), str) else None
    if fmt == "prompt" or (fmt == "auto" and "prompt" in record and "conversations" not in record
                           and "messages" not in record):
        prompt = record.get("prompt")
        if not isinstance(prompt, str):
            raise _Skip("non_string_content" if "prompt" in record else "no_turns", "prompt")
        if not prompt.strip():
            raise _Skip("empty_content", "prompt")
        return {"id": cid, "messages": [{"role": "user", "content": prompt}], "category": category}
    if fmt in ("auto", "sharegpt") and "conversations" in record:
        turns, key, role_key, content_key = record["conversations"], "conversations", "from", "value"
    elif fmt in ("auto", "messages") and "messages" in record:
        turns, key, role_key, content_key = record["messages"], "messages", "role", "content"
    else:
        raise _Skip("no_turns", "conversations" if fmt == "sharegpt" else "messages")
    if not isinstance(turns, list) or not turns:
        raise _Skip("no_turns", key)
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _Skip("not_an_object", f"{key}[{i}]")
        # ShareGPT files in the wild mix both spellings; accept either pair.
        role = turn.get(role_key, turn.get("role" if role_key == "from" else "from"))
        content = turn.get(content_key, turn.get("content" if content_key == "value" else "value"))
        if role is None:
            raise _Skip("missing_role", f"{key}[{i}].{role_key}")
        if not isinstance(role, str) or role.strip().lower() not in ROLE_ALIASES:
            shown = repr(role) if len(repr(role)) <= 40 else repr(role)[:40] + "…"  # cap what is echoed
            raise _Skip("unknown_role", f"{key}[{i}].{role_key}={shown}")
        if not isinstance(content, str):
            raise _Skip("non_string_content", f"{key}[{i}].{content_key}")
        if not content.strip():
            raise _Skip("empty_content", f"{key}[{i}].{content_key}")
        messages.append({"role": ROLE_ALIASES[role.strip().lower()], "content": content})
    if for_prompts:
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not any(m["role"] == "user" for m in messages):
            raise _Skip("no_user_turn", key)
        return {"id": cid, "messages": messages, "category": category}
    # ShareGPT splits long chats into chunks, and about a quarter of them start mid-chat with a
    # reply to a prompt that is not there. Those leading replies are dropped (as FastChat and EAGLE
    # do) and counted; a conversation with no user turn before its replies is skipped.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    leading = [i for i, m in enumerate(messages[: first_user]) if m["role"] == "assistant"]
    if leading:
        if first_user is None:
            raise _Skip("starts_with_assistant", f"{key}[{leading[0]}]")
        messages = [m for i, m in enumerate(messages) if i not in set(leading)]
        repairs.append("dropped_leading_assistant_turns")
    # Trailing user turns carry no supervision; drop them so that the conversation ends on a reply.
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        raise _Skip("no_assistant_turn", key)
    return {"id": cid, "messages": messages, "category": category}


def read_prompts(path: str | Path, limit: int | None = None) -> SourceRead:
    """Evaluation prompts: JSONL rows with `prompt` (plain text) or `messages`; optional id, category."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: prompt files are JSONL, one {{'prompt': ...}} or {{'messages': [...]}} per line")
    return read_conversations(path, fmt="auto", limit=limit, for_prompts=True)
