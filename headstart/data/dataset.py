"""From a recipe's `data` section to tokenised, loss-masked conversations and a train/held-out split.

Reading and normalising rows happens once in this process (it is cheap and its skip report must be
exact); rendering + tokenisation runs through `datasets.map` with `num_proc` workers and is cached
under `<cache>/datasets/<fingerprint>`, so a second run with the same source, tokenizer, template
and max_length is instant. The split is a hash of the conversation id, so it never depends on row
order, limit or process count.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from headstart.assets import DATASETS, cache_dir, prepare_data, resolve_data, resolve_model
from headstart.config import DataConfig
from headstart.data.sources import read_conversations
from headstart.data.template import ChatRenderer, TemplateMismatch
from headstart.errors import DataError
from headstart.fileio import atomic_path, atomic_write_text, file_lock, sha256_file

_FORMAT = 1  # bump when the processed columns or their meaning change


@dataclass
class DataStats:
    """The numbers `headstart data inspect` reports (the first four keys are a stable interface)."""

    conversations: int  # conversations kept (rendered, with at least one supervised token)
    skipped: dict[str, int]  # reason -> count, from reading and from rendering
    tokens: int
    supervised_tokens: int
    rows_read: int
    truncated: int  # conversations cut to max_length (kept)
    train_conversations: int
    heldout_conversations: int
    train_tokens: int
    heldout_tokens: int
    supervised_fraction: float
    repaired: dict[str, int] = field(default_factory=dict)  # kept rows that were fixed up, by repair
    skipped_examples: dict[str, list[str]] = field(default_factory=dict)
    unparsed_tail_bytes: int = 0


@dataclass
class BuiltData:
    train: Any  # datasets.Dataset with columns id, input_ids, loss_mask, num_tokens, ...
    heldout: Any
    stats: DataStats
    tokenizer: Any
    fingerprint: str


def load_tokenizer(model: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(model)))


def split_key(conversation_id: str, mode: str = "id") -> str:
    """The string the split hashes: the id, or (id_prefix) the id without a trailing "_<digits>"."""
    if mode == "id_prefix":
        head, sep, tail = conversation_id.rpartition("_")
        if sep and head and tail.isdigit():
            return head
    return conversation_id


def is_heldout(conversation_id: str, fraction: float) -> bool:
    """Deterministic by id: the same conversation lands on the same side in every run."""
    h = int.from_bytes(hashlib.sha256(conversation_id.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < fraction


class _RenderBatch:
    """The `datasets.map` function; holds the model path and loads its tokenizer once per worker."""

    def __init__(self, model_dir: str, max_length: int) -> None:
        self.model_dir = model_dir
        self.max_length = max_length
        self._renderer: ChatRenderer | None = None

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self._renderer is None:
            self._renderer = ChatRenderer(load_tokenizer(self.model_dir))
        out: dict[str, list] = {k: [] for k in
                                ("input_ids", "loss_mask", "num_tokens", "num_supervised", "truncated",
                                 "skip_reason")}
        for messages in batch["messages"]:
            try:
                r = self._renderer.render(messages, self.max_length)
                reason = "" if any(r.loss_mask) else (
                    "no_supervised_tokens_within_max_length" if r.truncated else "no_supervised_tokens"
                )
                ids, mask, truncated = r.input_ids, r.loss_mask, r.truncated
            except TemplateMismatch as e:
                ids, mask, truncated, reason = [], [], False, e.reason
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["num_tokens"].append(len(ids))
            out["num_supervised"].append(sum(mask))
            out["truncated"].append(truncated)
            out["skip_reason"].append(reason)
        return out


def content_sha256(path: Path) -> str:
    """sha256 of a file's bytes, remembered by (path, size, mtime) so that a large source is hashed
    once; `touch` or a rewrite with the same bytes leaves the hash (and every fingerprint) unchanged."""
    path = path.resolve()
    st = path.stat()
    memo = cache_dir() / "hashes" / (hashlib.sha256(str(path).encode()).hexdigest()[:24] + ".json")
    key = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        known = json.loads(memo.read_text())
        if isinstance(known, dict) and {k: known.get(k) for k in key} == key and isinstance(known.get("sha256"), str):
            return known["sha256"]
    except (OSError, ValueError):
        pass  # no memo yet, or a damaged one: hash again
    digest = sha256_file(path)
    try:
        atomic_write_text(memo, json.dumps({**key, "sha256": digest}))
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return digest


def _fingerprint(source: Path, cfg: DataConfig, model_dir: Path, tokenizer: Any) -> str:
    tok_file = model_dir / "tokenizer.json"
    parts = {
        "format": _FORMAT,
        "content_sha256": content_sha256(source),  # content, not path or mtime
        "data_format": cfg.format,
        "limit": cfg.limit,
        **({"max_turns": cfg.max_turns} if cfg.max_turns is not None else {}),  # earlier caches keep their key
        "max_length": cfg.max_length,
        "tokenizer": sha256_file(tok_file) if tok_file.exists() else str(model_dir.resolve()),
        "template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def _load_cached(out_dir: Path) -> tuple[dict[str, Any], Any] | None:
    """(stats, processed dataset) of a cache entry, or None when it is missing or damaged."""
    import datasets

    if not (out_dir / "stats.json").exists():
        return None
    try:
        base = json.loads((out_dir / "stats.json").read_text())
        processed = datasets.load_from_disk(str(out_dir / "processed"))
        len(processed["num_tokens"])  # reads the arrow data: a truncated file fails here
    except Exception:  # json, pyarrow and datasets each raise their own types for a damaged entry
        return None
    if not isinstance(base, dict) or "tokens" not in base:
        return None
    return base, processed


def build_dataset(cfg: DataConfig, model: str | Path, progress: bool = True) -> BuiltData:
    """Read, render, mask and split a recipe's data; cached by fingerprint."""

    model_dir = resolve_model(model)
    source = resolve_data(cfg.source)
    tokenizer = load_tokenizer(model_dir)
    fp = _fingerprint(source, cfg, model_dir, tokenizer)
    out_dir = cache_dir() / "datasets" / fp
    with file_lock(cache_dir() / "locks" / f"dataset-{fp}.lock"):
        cached = _load_cached(out_dir)
        if cached is None:  # absent, or damaged (a truncated arrow file, a bad stats.json): rebuilt
            _process(cfg, source, model_dir, out_dir, progress)
            cached = _load_cached(out_dir)
            if cached is None:
                raise DataError(f"{out_dir}: the tokenised cache cannot be read back after building it")
    base, processed = cached
    if cfg.source in DATASETS:  # report the cut-off tail of the packaged file, not of our clean cache
        base["unparsed_tail_bytes"] = prepare_data(cfg.source).bytes_unparsed
    heldout_flags = [is_heldout(split_key(i, cfg.split_key), cfg.heldout_fraction) for i in processed["id"]]
    train_idx = [i for i, h in enumerate(heldout_flags) if not h]
    held_idx = [i for i, h in enumerate(heldout_flags) if h]
    train, heldout = processed.select(train_idx), processed.select(held_idx)
    tokens = base["tokens"]
    stats = DataStats(
        conversations=len(processed),
        skipped=base["skipped"],
        tokens=tokens,
        supervised_tokens=base["supervised_tokens"],
        rows_read=base["rows_read"],
        truncated=base["truncated"],
        train_conversations=len(train),
        heldout_conversations=len(heldout),
        train_tokens=int(sum(train["num_tokens"])) if len(train) else 0,
        heldout_tokens=int(sum(heldout["num_tokens"])) if len(heldout) else 0,
        supervised_fraction=round(base["supervised_tokens"] / tokens, 4) if tokens else 0.0,
        repaired=base["repaired"],
        skipped_examples=base["skipped_examples"],
        unparsed_tail_bytes=base["unparsed_tail_bytes"],
    )
    return BuiltData(train, heldout, stats, tokenizer, fp)


def first_turns(messages: list[dict[str, str]], turns: int) -> list[dict[str, str]]:
    """The messages up to and including the `turns`-th assistant reply (all of them when there are fewer)."""
    seen = 0
    for i, m in enumerate(messages):
        seen += m["role"] == "assistant"
        if seen == turns:
            return messages[: i + 1]
    return messages


def _process(cfg: DataConfig, source: Path, model_dir: Path, out_dir: Path, progress: bool) -> None:
    import datasets

    read = read_conversations(source, cfg.format, cfg.limit)
    if cfg.max_turns is not None:
        for c in read.conversations:
            c["messages"] = first_turns(c["messages"], cfg.max_turns)
    skipped: Counter = Counter(read.skipped)
    examples = {k: list(v) for k, v in read.examples.items()}
    if not read.conversations:
        raise DataError(
            f"{source}: none of the {read.rows} rows is a usable conversation; skipped: "
            f"{_fmt_reasons(skipped, examples)}"
        )
    n = len(read.conversations)
    num_proc = cfg.num_proc or max(1, min(os.cpu_count() or 1, n // 2000))
    ds = datasets.Dataset.from_list(
        [{"id": c["id"], "messages": c["messages"]} for c in read.conversations]
    )
    if not progress:
        datasets.disable_progress_bars()
    try:
        ds = ds.map(
            _RenderBatch(str(model_dir), cfg.max_length),
            batched=True,
            batch_size=64,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=["messages"],
            desc=f"render + tokenise ({num_proc} proc)",
        )
    finally:
        if not progress:
            datasets.enable_progress_bars()
    reasons = ds["skip_reason"]
    for i, reason in enumerate(reasons):
        if reason:
            skipped[reason] += 1
            shown = examples.setdefault(reason, [])
            if len(shown) < 3:
                shown.append(f"{source.name}: conversation id {ds[i]['id']!r}")
    kept = ds.filter(lambda r: not r, input_columns=["skip_reason"]).remove_columns(["skip_reason"])
    tokens = int(sum(kept["num_tokens"])) if len(kept) else 0
    supervised = int(sum(kept["num_supervised"])) if len(kept) else 0
    if supervised == 0:
        raise DataError(
            f"{source}: the data yields zero supervised (assistant) tokens after rendering with the target's "
            f"chat template and max_length={cfg.max_length}; nothing would be trained. Skipped: "
            f"{_fmt_reasons(skipped, examples)}"
        )
    stats = {
        "rows_read": read.rows,
        "skipped": dict(skipped),
        "skipped_examples": examples,
        "repaired": dict(read.repaired),
        "unparsed_tail_bytes": read.unparsed_tail_bytes,
        "tokens": tokens,
        "supervised_tokens": supervised,
        "truncated": int(sum(kept["truncated"])),
    }
    # A damaged entry of this cache (same fingerprint, same layout) is rebuilt in place.
    with atomic_path(out_dir, replaces=lambda p: (p / "processed").is_dir() or (p / "stats.json").is_file()) as tmp:
        kept.save_to_disk(str(tmp / "processed"))
        atomic_write_text(tmp / "stats.json", json.dumps(stats, indent=2))


def _fmt_reasons(skipped: Counter, examples: dict[str, list[str]]) -> str:
    if not skipped:
        return "nothing"
    return "; ".join(f"{r}: {n} (e.g. {', '.join(examples.get(r, [])[:2])})" for r, n in skipped.most_common())


def stats_dict(stats: DataStats) -> dict[str, Any]:
    return asdict(stats)
