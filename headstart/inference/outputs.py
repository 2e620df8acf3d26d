"""What the engine hands back: a request's output (`RequestOutput`) and its running counters
(`EngineStats`). Below the engine and its speculative step, which both build them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)  # produced by the last step
    logprobs: list[dict] = field(default_factory=list)
    spec_metrics: dict[str, Any] | None = None  # acceptance metrics of this request (speculation on)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed (prefix_cache=True)
    seconds: float = 0.0
