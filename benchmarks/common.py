"""Shared helpers for the benchmark scripts (prompts from the embedded ShareGPT, timing)."""

from __future__ import annotations

import time
from collections.abc import Callable

from headstart.assets import resolve_data
from headstart.data.sources import read_conversations


def sharegpt_prompts(n: int, max_chars: int = 1200, skip: int = 0) -> list[list[dict[str, str]]]:
    """The first user turn of the first n usable ShareGPT conversations (after `skip`), as chat messages."""
    firsts = []
    for conv in read_conversations(resolve_data("sharegpt"), limit=max(2000, 50 * (n + skip))).conversations:
        first = next(m for m in conv["messages"] if m["role"] == "user")
        if len(first["content"]) <= max_chars:
            firsts.append([first])
    if len(firsts) < n + skip:
        raise ValueError(f"only {len(firsts)} ShareGPT prompts of <= {max_chars} characters in the rows read")
    return firsts[skip:skip + n]


def timed(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start
