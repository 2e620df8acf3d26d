"""`headstart regenerate`: rewrite every assistant turn of a dataset with the target itself.

User and system turns are kept; assistant turn k is regenerated from the conversation so far (with
the earlier turns already regenerated), so heads learn the target's own distribution. Conversations
stream through the engine (continuous batching): a conversation's next turn, or the next
conversation, takes a slot the moment a reply finishes. Each finished conversation is appended to
`<output>.partial` at once (flushed and synced); `--resume` keeps its complete lines and skips those
ids; when everything is done the rows are written to `<output>` in source order. Sampling seeds derive from
the recipe seed and the conversation id, so a resumed run writes what an uninterrupted one would. A
greedy run may be resumed with the other engine (`regenerate.engine`: the faster one on the machine at
hand); each row names the engine that wrote it.
A finished run grows with a larger `regenerate.limit` and `--resume`: the next source rows are
added to it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from headstart.config import Recipe
from headstart.console import status
from headstart.errors import DataError
from headstart.fileio import atomic_path, atomic_write_text, read_json_object

_ROLE_OUT = {"user": "human", "assistant": "gpt", "system": "system"}


def output_path(recipe: Recipe) -> Path:
    return Path(recipe.regenerate.output or Path(recipe.output_dir) / "regenerated.jsonl")


def check_regenerated_source(recipe: Recipe, recipe_path: str | Path) -> None:
    """A data.source that is this recipe's regenerate output and is not there yet: say which verb
    writes it (a fresh checkout has no runs/), instead of "unknown data source"."""
    from headstart.assets import DATASETS

    src = Path(recipe.data.source).expanduser()
    if recipe.data.source in DATASETS or src.is_file() or src.resolve() != output_path(recipe).resolve():
        return
    raise DataError(f"data.source {recipe.data.source}: not written yet; it is what `headstart regenerate "
                    f"{recipe_path}` writes (the target's own answers to regenerate.source): run that first, or point "
                    "data.source at a conversation file")


def _seed(base: int, conv_id: str, turn: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{base}:{conv_id}:{turn}".encode()).digest()[:4], "big")


def _done_ids(partial: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is cut off the file."""
    if not partial.exists():
        return set()
    data = partial.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    ids = set()
    for line in keep.decode("utf-8").split("\n")[:-1]:  # not splitlines(): U+2028 etc. occur inside JSON strings
        ids.add(json.loads(line)["id"])
    if len(keep) != len(data):
        with open(partial, "r+b") as f:
            f.truncate(len(keep))
    return ids


def _ours(out: Path, run_file: Path) -> bool:
    """Whether `out` is an earlier regenerate output: a file with a run record beside it, or whose first
    row carries the `regenerated` provenance regenerate writes into every row."""
    if not out.is_file():
        return False
    if run_file.is_file():
        return True
    try:
        with open(out, encoding="utf-8") as f:
            first = f.readline()
        row = json.loads(first) if first.strip() else None
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(row, dict) and isinstance(row.get("regenerated"), dict)


def limit_of(recipe: Recipe) -> int | None:
    return recipe.regenerate.limit if recipe.regenerate.limit is not None else recipe.data.limit


def _larger(new: int | None, old: Any) -> bool:
    """Whether source limit `new` reads every row `old` did and more (None: every row)."""
    return isinstance(old, int) and (new is None or new > old)


def _grows(run_file: Path, limit: int | None) -> bool:
    """Whether a finished run's record says it read fewer source rows than `limit` asks for. The rows
    are read in source order, so the larger run's first rows are the finished run's: extending it
    writes what one run with the larger limit would (each row keeps the limit it was made under)."""
    return run_file.exists() and _larger(limit, read_json_object(run_file, "run record").get("limit"))


def run_regenerate(recipe: Recipe, resume: bool = False, progress: bool = True, minutes: float | None = None,
                   pieces: str | Path | None = None) -> Path:
    """Regenerate; `minutes`: stop starting conversations after that long and leave the run resumable
    (the ones in flight are dropped, as a kill would); `pieces`: carry the run across machines in that
    directory (headstart.precompute.pieces: restored before, the new rows saved as the next piece after)."""
    from headstart.inference import Engine

    if minutes is not None and not minutes > 0:
        raise DataError(f"--minutes {minutes}: must be > 0")
    cfg = recipe.regenerate
    if recipe.engine.tensor_parallel > 1:
        raise DataError(f"engine.tensor_parallel {recipe.engine.tensor_parallel}: regenerate does not shard the "
                        "target yet (precompute and eval do)")
    out = output_path(recipe)
    partial = out.with_name(out.name + ".partial")
    run_file = out.with_name(out.name + ".run.json")
    source = cfg.source or recipe.data.source
    if Path(source).resolve() == out.resolve():
        raise DataError(f"regenerate: the source {source} is the output; set regenerate.source to the conversations "
                        "to rewrite")
    if pieces is not None:
        resume = True  # the pieces are an interrupted run by construction (restored in _run)
    if out.exists() and not _ours(out, run_file):  # a user's file or directory: no advice about growing it
        raise DataError(f"{out} already exists and is not a regenerate output (a JSONL file whose rows carry "
                        "`regenerated` provenance); regenerate never writes over it: set regenerate.output to a new "
                        "file")
    if out.exists():
        if not resume:
            raise DataError(f"{out} already exists; remove it, set regenerate.output, or raise regenerate.limit "
                            "and pass --resume to add the next source rows to it")
        if not _grows(run_file, limit_of(recipe)):
            done = read_json_object(run_file, "run record").get("limit") if run_file.exists() else None
            read = f"read regenerate.limit={str(done)[:20]} source rows" if run_file.exists() else "has no run record"
            raise DataError(f"--resume: {out} already exists, a finished run that {read}, and regenerate.limit is "
                            f"{limit_of(recipe)}: there is nothing to add. Raise regenerate.limit above "
                            f"{done if isinstance(done, int) else 'the rows it read'} (--set regenerate.limit=N) to "
                            "add the next source rows, or remove it / set regenerate.output to start afresh")
        extend = True  # renamed to the partial file once its provenance matches (below)
    else:
        extend = False
    import torch

    from headstart.inference.backends import check_backend

    check_backend(recipe.engine.backend, torch.device("cpu"), None)  # the engine below runs on the CPU
    try:  # an unwritable destination is found before the engine loads, not after hours of decoding
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise DataError(f"{partial}: cannot be written ({e.strerror or e}); set regenerate.output") from None
    from headstart.hardware import resolve_dtype

    # Nothing here compares a token with its own speculative re-run, so torch's blocked kernels serve
    # the prompts (a long prefill costs 1.4-2x less than with the row-invariant ones).
    if cfg.engine == "vllm":  # vLLM's own sampler: the engine is part of the provenance (rows and run record)
        import shutil
        import tempfile

        from headstart.assets import resolve_model
        from headstart.engines.vllm_session import VLLMGenerator

        # vLLM's job and log live outside the output directory (train refuses files it did not write there);
        # kept, and named by the error, when vLLM fails
        work = Path(tempfile.mkdtemp(prefix="headstart-regenerate-vllm-"))
        engine = VLLMGenerator(resolve_model(recipe.target.model), resolve_dtype(recipe.target.dtype),
                               cfg.batch_size, recipe.seed, work)
        try:
            done = _run(recipe, engine, out, partial, run_file, source, extend, resume, progress, minutes, pieces)
        finally:
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
        return done
    engine = Engine(recipe.target.model, dtype=resolve_dtype(recipe.target.dtype), max_batch_size=cfg.batch_size,
                    seed=recipe.seed, batch_invariant=False, backend=recipe.engine.backend,
                    prefix_cache=recipe.regenerate.prefix_cache)
    return _run(recipe, engine, out, partial, run_file, source, extend, resume, progress, minutes, pieces)


def _run(recipe: Recipe, engine: Any, out: Path, partial: Path, run_file: Path, source: str, extend: bool,
         resume: bool, progress: bool, minutes: float | None = None, pieces: str | Path | None = None) -> Path:
    import time

    from tqdm import tqdm

    from headstart.assets import resolve_data
    from headstart.data.sources import read_conversations
    from headstart.inference import SamplingParams

    cfg = recipe.regenerate
    limit = limit_of(recipe)
    provenance = {"model": recipe.target.model, "target_fingerprint": engine.model.fingerprint(),
                  "temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens,
                  "seed": recipe.seed, "source": source, "limit": limit, "max_turns": cfg.max_turns,
                  "max_prompt_tokens": cfg.max_prompt_tokens}
    if cfg.max_context_tokens is not None:  # recorded only when set: earlier runs' records stay resumable
        provenance["max_context_tokens"] = cfg.max_context_tokens
    if cfg.engine != "headstart":  # recorded only when not ours: earlier runs' records stay resumable
        provenance["engine"] = cfg.engine
    restored: list[tuple[str, str]] = []
    records: list[tuple[Any, dict[str, Any]]] = []  # (where, record) of what this run continues
    if pieces is not None:  # read and checked whole before anything is written
        from headstart.precompute.pieces import append_missing, load

        record, restored = load(Path(pieces))
        if record is not None and (diff := _differs(provenance, record)):
            raise DataError(f"--pieces {pieces}: made with a different {', '.join(diff)}; they belong to another run")
        records += [(pieces, record)] if record is not None else []
    if partial.stat().st_size or run_file.exists():
        if not resume:
            raise DataError(f"{partial} holds an unfinished run; pass --resume to continue it")
        prev = read_json_object(run_file, "run record") if run_file.exists() else {}
        if diff := _differs(provenance, prev):
            raise DataError(f"{partial} was made with a different {', '.join(diff)}; refusing to resume")
        records.append((partial, prev))
        if extend:  # a finished run extended to a larger limit: its rows are kept and skipped
            from headstart.precompute.pieces import append_missing

            lines = out.read_text(encoding="utf-8").split("\n")[:-1]
            append_missing(partial, [(json.loads(x)["id"], x) for x in lines])
            out.unlink()
        if prev.get("limit") != limit or prev.get("engine") != provenance.get("engine"):  # the record: the last
            atomic_write_text(run_file, json.dumps(provenance, indent=2))
    else:
        atomic_write_text(run_file, json.dumps(provenance, indent=2))
    if progress:  # once every record is checked: nothing is announced that a refusal then contradicts
        _engine_changed(provenance, records)
    if restored and (added := append_missing(partial, restored)) and progress:
        status(f"regenerate: {added:,} conversations restored from {pieces} into {partial}")
    done = _done_ids(partial)
    read = read_conversations(resolve_data(source), recipe.data.format, limit)
    if cfg.max_prompt_tokens is not None:  # a long first prompt costs a long prefill and is cut in training
        def first_prompt_tokens(conv: dict[str, Any]) -> int:
            turns = conv["messages"]
            upto = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))
            return len(engine.encode(turns[:upto] or turns[:1]))

        kept = [c for c in read.conversations if first_prompt_tokens(c) <= cfg.max_prompt_tokens]
        read.skipped["prompt longer than regenerate.max_prompt_tokens"] = len(read.conversations) - len(kept)
        read.conversations = kept
    todo = [c for c in read.conversations if c["id"] not in done]
    bar = tqdm(total=len(read.conversations), initial=len(read.conversations) - len(todo), unit="conv",
               desc="regenerate", disable=not progress)
    feed = _StepFeed(engine) if hasattr(engine, "step") else _StreamFeed(engine)
    pool = cfg.batch_size + cfg.batch_size // 2  # a turn waits for its slot; a finished one's is filled at once
    with open(partial, "a", encoding="utf-8") as f:
        def finished(row: dict[str, Any]) -> None:  # on disk as soon as its last reply is in
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(1)

        deadline = time.monotonic() + minutes * 60 if minutes is not None else None
        try:
            complete = _converse(feed, todo, pool, cfg, recipe.seed, provenance, SamplingParams, engine.encode,
                                 finished, deadline)
        except KeyboardInterrupt:  # Ctrl-C ends a piece too: what finished is kept
            if pieces is not None:
                f.flush()
                _save_piece(pieces, partial, run_file, progress)
            raise
    bar.close()
    if pieces is not None:  # before the partial file becomes the output: a crash in between loses nothing
        _save_piece(pieces, partial, run_file, progress)
    if not complete:
        left = len(read.conversations) - len(_done_ids(partial))
        if progress:
            status(f"regenerate: stopped after {minutes:g} min (--minutes): {left:,} of {len(read.conversations):,} "
                   f"conversations still to do; {partial} keeps the finished ones: run again with --resume"
                   + (f" --pieces {pieces}" if pieces is not None else ""))
        return partial
    totals = _in_source_order(partial, out, [c["id"] for c in read.conversations])
    if progress:
        status(f"regenerate: {totals['conversations']:,} conversations, {totals['turns']:,} assistant turns, "
               f"{totals['tokens']:,} answer tokens -> {out} ({sum(read.skipped.values())} source rows skipped)")
        stats = getattr(engine, "stats", None)
        if stats is not None and stats.prefill_tokens + stats.cached_tokens:  # this run's prompts, ours only
            status(f"regenerate: {stats.prefill_tokens:,} prompt tokens prefilled, {stats.cached_tokens:,} taken from "
                   "the prefix cache instead (regenerate.prefix_cache)")
    return out


def _differs(provenance: dict[str, Any], prev: dict[str, Any]) -> list[str]:
    """The provenance keys a run record disagrees on (a larger source limit is a run that grew; a greedy
    run may change engine, see _engine_changed)."""
    return [k for k, v in {**provenance, "engine": provenance.get("engine"),
                           "max_context_tokens": provenance.get("max_context_tokens")}.items()
            if prev.get(k) != v and not (k == "limit" and _larger(v, prev.get(k)))
            and not (k == "engine" and _greedy(provenance) and _greedy(prev))]


def _greedy(record: dict[str, Any]) -> bool:
    return record.get("temperature") == 0


def _engine_changed(provenance: dict[str, Any], records: list[tuple[Any, dict[str, Any]]]) -> None:
    """Greedy answers are the target's argmax whichever engine computes it (ours and vLLM write the same
    text in fp32, tests/test_vllm.py; bf16 differs as batch composition does), so a greedy run may go on
    with the faster engine; each row names its own (`regenerated.engine`, absent: ours). Sampled runs
    keep one engine: the samplers differ."""
    for where, prev in records:
        if prev and prev.get("engine") != provenance.get("engine"):
            status(f"regenerate: {where} was made with engine {prev.get('engine') or 'headstart'}; greedy, so it goes "
                   f"on with {provenance.get('engine') or 'headstart'} (each row names the engine that wrote it)")


def _save_piece(pieces: str | Path, rows_file: Path, run_file: Path, progress: bool) -> None:
    from headstart.precompute.pieces import save

    path = save(Path(pieces), rows_file, run_file)
    if progress:
        status(f"regenerate: new piece {path}" if path else f"regenerate: no new conversations for {pieces}")


def _in_source_order(partial: Path, out: Path, ids: list[str]) -> dict[str, int]:
    """Write the finished rows to `out` in source order (they reach the partial file in the order they
    finish, which depends on batching and on where a run was resumed), atomically; count what they hold."""
    data = partial.read_bytes().decode("utf-8")
    rows = {}
    for line in data.split("\n")[:-1]:  # not splitlines(): U+2028 etc. occur inside JSON strings
        rows[json.loads(line)["id"]] = line
    order = [i for i in ids if i in rows]
    order += [i for i in rows if i not in set(order)]  # none expected: kept rather than dropped
    totals = {"conversations": len(order), "turns": 0, "tokens": 0}
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for i in order:
            f.write(rows[i] + "\n")
            made = json.loads(rows[i])["regenerated"]
            totals["turns"] += len(made.get("finish_reasons", []))
            totals["tokens"] += sum(made.get("tokens", []))
        f.flush()
        os.fsync(f.fileno())
    partial.unlink()  # regenerate's own <output>.partial, now in <output>
    return totals


class _StepFeed:
    """Our engine, request by request: each reply comes back the step it finishes, and the next turn
    (or the next conversation) takes its slot at once."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def submit(self, key: str, prompt: list[dict[str, str]], params: Any) -> None:
        self.engine.add_request(prompt, params, request_id=key)

    def collect(self) -> list[tuple[str, Any]]:
        return [(o.id, o) for o in self.engine.step() if o.finished]


class _StreamFeed:
    """vLLM's worker, request by request: each turn joins vLLM's running batch when it is submitted, and
    comes back when it finishes. (Before, vLLM got waves of 4 x batch turns and each wave waited for its
    longest: its slots were under-filled in 35% of the log's intervals, 166 against 276 tokens/s.)"""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def submit(self, key: str, prompt: list[dict[str, str]], params: Any) -> None:
        self.engine.submit(key, prompt, params)

    def collect(self) -> list[tuple[str, Any]]:
        return self.engine.collect()


def _converse(feed: Any, todo: list[dict[str, Any]], pool: int, cfg: Any, seed: int, provenance: dict[str, Any],
              sampling_params: Any, encode: Any, finished: Any, deadline: float | None = None) -> bool:
    """Regenerate `todo`'s assistant turns, up to `pool` conversations in flight: turn k of a
    conversation is asked once its turn k-1 is answered; `finished(row)` gets each conversation the
    moment its last reply is in, so an interrupted run loses only the conversations in flight. Past
    `deadline` (time.monotonic()) it returns False, dropping those in flight; True once all are done."""
    import time

    active: dict[str, dict[str, Any]] = {}
    waiting = iter(todo)

    def advance(st: dict[str, Any]) -> None:
        msgs = st["conv"]["messages"]
        while st["pos"] < len(msgs) and msgs[st["pos"]]["role"] != "assistant":
            st["out"].append(msgs[st["pos"]])
            st["pos"] += 1
        turn = len(st["reasons"])
        too_long = (cfg.max_context_tokens is not None and turn > 0 and st["pos"] < len(msgs)
                    and len(encode(st["out"])) >= cfg.max_context_tokens)
        if (cfg.max_turns is not None and turn >= cfg.max_turns) or too_long:
            st["pos"] = len(msgs)  # the rest of the conversation is dropped, not kept stale
            while st["out"] and st["out"][-1]["role"] != "assistant":
                st["out"].pop()
        if st["pos"] >= len(msgs):
            finished({"id": st["conv"]["id"],
                      "conversations": [{"from": _ROLE_OUT[m["role"]], "value": m["content"]} for m in st["out"]],
                      "regenerated": {**provenance, "finish_reasons": st["reasons"], "tokens": st["tokens"]}})
            return
        key = f"{st['conv']['id']}\x00{turn}"
        active[key] = st
        feed.submit(key, list(st["out"]), sampling_params(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                                          top_p=cfg.top_p, seed=_seed(seed, st["conv"]["id"], turn)))

    def refill() -> None:
        while len(active) < pool:
            conv = next(waiting, None)
            if conv is None:
                return
            advance({"conv": conv, "out": [], "pos": 0, "reasons": [], "tokens": []})

    refill()
    while active:
        if deadline is not None and time.monotonic() > deadline:
            return False
        for key, res in feed.collect():
            st = active.pop(key)
            st["out"].append({"role": "assistant", "content": res.text})
            st["reasons"].append(res.finish_reason)
            st["tokens"].append(len(res.token_ids))
            st["pos"] += 1
            advance(st)
        refill()
    return True
