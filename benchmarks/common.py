"""Shared helpers for the benchmark scripts (prompts from the embedded ShareGPT, timing)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from headstart.assets import prepare_data
from headstart.data.sources import normalise


def sharegpt_prompts(n: int, max_chars: int = 1200, skip: int = 0) -> list[list[dict[str, str]]]:
    """The first user turn of the first n usable ShareGPT conversations, as chat messages."""
    out = []
    with open(prepare_data("sharegpt").path, encoding="utf-8") as f:
        for line in f:
            try:
                conv = normalise(json.loads(line))
            except Exception:
                continue
            first = next(m for m in conv["messages"] if m["role"] == "user")
            if len(first["content"]) > max_chars:
                continue
            if skip:
                skip -= 1
                continue
            out.append([first])
            if len(out) == n:
                break
    return out


def timed(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start
