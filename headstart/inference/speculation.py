"""What a speculative run is asked to do and what it measured: `SpecConfig`, `SpecMetrics`, and which
speculation method each head family drafts with (`spec_method`).

Below the scheduler and the proposers (both read these), and the one place the rule "head type ->
method" is written: training's validation, `headstart eval` and eval's vLLM rows all name a head's
method through `spec_method`, so their rows pair up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from headstart.heads.config import CHAIN_HEADS

SpecMethod = Literal["chain", "draft", "medusa", "tree", "ngram", "block"]
SPEC_METHODS = ("chain", "draft", "medusa", "tree", "ngram", "block")


@dataclass(kw_only=True)
class SpecConfig:
    method: SpecMethod
    k: int = 3  # draft tokens per step (Medusa: at most its number of heads)
    head: Any = None  # a DraftHead (chain: mtp/eagle1/deepseek_mtp/eagle3; medusa; block: dflash), or a checkpoint dir
    draft: Any = None  # method "draft": a DraftLM head, a LlamaForCausalLM, or a model name / directory
    draft_sampling: bool = False  # sample drafts from q and verify with the full-q rule (else argmax + one-hot)
    tree_topk: int = 4  # tree: children per expanded node, and nodes expanded per depth
    tree_tokens: int = 16  # tree: draft tokens kept after reranking (verified in one pass); k is the depth
    allow_other_target: bool = False  # load a head checkpoint made for a same-shaped target with other weights
    # chain / draft: stop drafting a step once the draft's top probability for the token just drafted
    # falls below this (easy text drafts up to k, hard text stops early); None: always k.
    draft_threshold: float | None = None
    ngram_min: int = 2  # ngram: shortest suffix looked up in the sequence's own tokens
    ngram_max: int = 4  # ngram: longest suffix looked up (tried first)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculation method {self.method!r}; choose {', '.join(SPEC_METHODS)}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.draft_threshold is not None:
            if self.method not in ("chain", "draft"):
                raise ValueError(f"draft_threshold applies to chain and draft drafting, not {self.method}")
            if not 0.0 < self.draft_threshold < 1.0:
                raise ValueError(f"draft_threshold must be in (0, 1), got {self.draft_threshold}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram needs 1 <= ngram_min <= ngram_max, got {self.ngram_min} / {self.ngram_max}")
        if self.method == "tree" and (self.tree_topk < 1 or self.tree_tokens < 1):
            raise ValueError("tree_topk and tree_tokens must be >= 1")

    @property
    def lookahead(self) -> int:
        """KV slots reserved beyond the sequence for one speculative step: the pending token and k
        drafts, a tree's nodes, or a DFlash head's whole block (its drafter runs every position it was
        trained on, whatever k; the engine resolves a head given as a path before it reads this)."""
        if self.method == "tree":
            return 1 + max(self.tree_tokens, self.tree_topk * self.k)
        if self.method == "block" and hasattr(self.head, "block_size"):
            return max(self.k + 1, self.head.block_size)
        return self.k + 1


@dataclass
class SpecMetrics:
    """Acceptance metrics with the names of docs/acceptance.md (accepted counts exclude the bonus), kept as
    running counts: adding a step and reading the summary cost O(k), not O(steps)."""

    positions: int | None = None  # longest acceptable run (tree: its depth); default: max drafted
    steps: int = 0
    accepted_total: int = 0
    drafted_total: int = 0
    drafted_max: int = 0
    histogram: list[int] = field(default_factory=list)  # histogram[a] = steps that accepted a drafts
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def add(self, a: int, d: int) -> None:
        self.steps += 1
        self.accepted_total += a
        self.drafted_total += d
        self.drafted_max = max(self.drafted_max, d)
        if a >= len(self.histogram):
            self.histogram.extend([0] * (a + 1 - len(self.histogram)))
        self.histogram[a] += 1

    def merge(self, other: SpecMetrics) -> None:
        self.steps += other.steps
        self.accepted_total += other.accepted_total
        self.drafted_total += other.drafted_total
        self.drafted_max = max(self.drafted_max, other.drafted_max)
        if len(other.histogram) > len(self.histogram):
            self.histogram.extend([0] * (len(other.histogram) - len(self.histogram)))
        for a, count in enumerate(other.histogram):
            self.histogram[a] += count
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds

    def summary(self) -> dict[str, Any]:
        n = self.steps
        k = self.positions or self.drafted_max
        if n == 0:
            return {"steps": 0, "tau": None, "alpha": None, "accept_rate_per_pos": [], "cond_accept_per_pos": [],
                    "accept_histogram": []}
        hist = (self.histogram + [0] * (k + 1))[: max(k + 1, len(self.histogram))]
        at_least = [sum(hist[i:]) for i in range(len(hist))]  # at_least[i] = steps with a >= i
        rate = [at_least[i + 1] / n for i in range(k)]
        cond = [rate[0]] + [rate[i] / rate[i - 1] if rate[i - 1] else 0.0 for i in range(1, k)] if k else []
        return {
            "steps": n,
            "tau": 1 + self.accepted_total / n,
            "alpha": self.accepted_total / max(1, self.drafted_total),
            "accept_rate_per_pos": rate,
            "cond_accept_per_pos": cond,
            "accept_histogram": hist[: k + 1],
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
        }


_METHOD_OF_HEAD = {"medusa": "medusa", "draft_lm": "draft", "dflash": "block"}


def spec_method(head_type: str) -> str:
    """The speculation method a head family drafts with (chain for the EAGLE / MTP families)."""
    return _METHOD_OF_HEAD.get(head_type, "chain")


def heads_for(method: str) -> tuple[str, ...]:
    """The head families a method takes (a tree is drafted by a chain head)."""
    if method in ("chain", "tree"):
        return CHAIN_HEADS
    return tuple(t for t, m in _METHOD_OF_HEAD.items() if m == method)
