"""Continuous batching: a waiting queue, running sequences, token-budgeted steps, preemption.

Every step schedules, per sequence, how many of its not-yet-cached tokens to run: 1 for a decoding
sequence, up to the remaining budget for a prefill (so long prompts are chunked), which makes
prefill, decode and mixed batches one mechanism. When the KV cache is out of pages the most
recently admitted running sequence is preempted: its pages are released and it goes back to the
front of the queue, to be recomputed (prompt + what it generated) when pages free up.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from headstart.inference.kv_cache import PageAllocator
from headstart.inference.sampler import SamplingParams
from headstart.inference.speculation import SpecMetrics
from headstart.sizing import KV_PAGE_TOKENS, KV_SPARE_PAGES, MEASURED_PREFILL_CAP

# A speculative step needs every running sequence decoding. Sequences whose prompts finished prefilling first
# used to take plain decode steps while the others prefilled, so they started speculating a few tokens into their
# answers, where drafting is easier, and a head's tau depended on the batch it was measured in (64 prompts at
# once: +0.004 over the same prompts 8 at a time, SmolLM2, greedy k 3). Scheduler(hold_decodes=True), which a
# speculating batch-invariant engine uses, makes them wait instead. Where acceptance is measured (eval,
# training's validation) every prompt of a batch group also prefills in one step, so nothing waits at all.
# The one-step prefill's cap is sizing.MEASURED_PREFILL_CAP (plan counts with it too). Larger sets are measured a
# part at a time (validation) or prefilled in chunks (an eval batch group, whose size is the user's): the hold keeps
# their traces exact.
DEFAULT_BATCHED_TOKENS = 2048  # the engine's token budget per step (Engine(max_batched_tokens=...))


def one_step_prefill_budget(prompts: list[list[int]], batch: int | None = None, default: int = DEFAULT_BATCHED_TOKENS,
                            cap: int | None = None) -> int:
    """The token budget under which each batch group of `prompts` (`batch` consecutive prompts; default all of
    them) prefills in one step: `default` or the largest group's prompt tokens, at most `cap`
    (MEASURED_PREFILL_CAP)."""
    cap = MEASURED_PREFILL_CAP if cap is None else cap
    batch = batch or max(len(prompts), 1)
    largest = max([sum(map(len, prompts[i:i + batch])) for i in range(0, len(prompts), batch)], default=0)
    return min(max(default, largest), max(default, cap))


def prompts_at_once(prompts: list[list[int]], cap: int | None = None) -> int:
    """How many of `prompts` a measuring engine runs together so that each prefills in one step: all of them when
    they hold at most `cap` tokens (MEASURED_PREFILL_CAP), else len x cap // their tokens (at least 1)."""
    cap = MEASURED_PREFILL_CAP if cap is None else cap
    total = sum(map(len, prompts))
    return len(prompts) if total <= cap else max(1, len(prompts) * cap // total)


def kv_pages_for(prompts: list[list[int]], max_tokens: int, batch: int, lookahead: int = 0,
                 page_size: int = KV_PAGE_TOKENS, context: int | None = None) -> int:
    """KV pages for the `batch` longest requests of `prompts` at once (each prompt + `max_tokens`, at most
    `context`, + `lookahead` + 1 slots, in whole pages plus one), + KV_SPARE_PAGES: whichever of them run together, none
    is preempted. Sized by the longest that can run together, not `batch` x the longest of all (one very
    long prompt among short ones would otherwise size every slot for it)."""
    def need(p: list[int]) -> int:
        tokens = len(p) + max_tokens if context is None else min(len(p) + max_tokens, context)
        return -(-(tokens + lookahead + 1) // page_size) + 1

    return sum(sorted(map(need, prompts), reverse=True)[:max(batch, 1)]) + KV_SPARE_PAGES


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DraftState:
    """A proposer's state for one request; it lives on the Sequence and dies with it."""

    cached: int = 0  # rows of the draft's KV cache that are valid
    carry: tuple[torch.Tensor, torch.Tensor] | None = None  # (features, logits) of its last row
    generator: torch.Generator | None = None  # drafting draws (never the verifier's stream)


@dataclass(eq=False)
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    seed: int = 0  # the seed of `generator` (the request's own, or one the engine drew for it)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "length", "stop" (EOS, stop token or string), "abort"
    text: str = ""  # detokenised output, cut at a stop string
    logprobs: list[dict] = field(default_factory=list)
    num_preemptions: int = 0
    spec_metrics: SpecMetrics = field(default_factory=SpecMetrics)
    detok: Any = None  # IncrementalText when the engine has a tokenizer
    draft: DraftState = field(default_factory=DraftState)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens run per sequence this step
    sample_rows: list[int]  # row (within the flat batch) whose logits each sampling sequence uses
    samplers: list[Sequence]  # sequences that produce a token this step (their chunk reaches the end)
    items: list[tuple[str, int, int]]  # (seq id, start, end): the KV indices run (headstart.inference.runner)
    input_ids: torch.Tensor  # (N,)


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_batch_size: int, max_batched_tokens: int,
                 device: torch.device, hold_decodes: bool = False) -> None:
        self.allocator = allocator
        # speculation with batch-invariant kernels: a sequence whose prompt is done waits while others prefill
        # (schedule()), so it speculates from its first generated token whatever shares its steps
        self.hold_decodes = hold_decodes
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.device = device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.cached_tokens = 0  # prompt tokens admitted from the prefix cache (counted once per admission)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq_id: str) -> Sequence | None:
        for seq in list(self.running) + list(self.waiting):
            if seq.id == seq_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.allocator.release(seq.id)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def truncate(self, seq: Sequence) -> None:
        """Drop the slots reserved past the sequence's cached tokens (rejected drafts); the allocator
        is changed here and in the scheduling methods only."""
        self.allocator.rollback(seq.id, self.allocator.length(seq.id) - seq.num_cached)

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.release(seq.id)
        seq.num_cached, seq.status = 0, Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's chunks. With hold_decodes, sequences that only have their last sampled token to
        run (decoding) sit the step out while another running or admissible sequence still prefills: a
        speculative step needs every running sequence decoding, and a sequence that decoded plainly meanwhile
        would start speculating a few tokens into its answer (where drafting is easier), so its acceptance would
        depend on what shared its steps. Never at the cost of an empty step: if no prefill can be scheduled
        (no pages for it), the held sequences run."""
        if self.hold_decodes and self._prefill_pending():
            batch = self._schedule(hold=True)
            if batch is not None:
                return batch
        return self._schedule(hold=False)

    def admission_pending(self) -> bool:
        """A waiting request has a free place in the batch: it is admitted (prefilled) next step, which no
        speculative step can take."""
        return bool(self.waiting) and len(self.running) < self.max_batch_size

    def _prefill_pending(self) -> bool:
        return any(s.total_len - s.num_cached > 1 for s in self.running) or self.admission_pending()

    def _schedule(self, hold: bool) -> ScheduledBatch | None:
        budget = self.max_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted below to make room for an earlier sequence
                continue
            n = min(seq.total_len - seq.num_cached, budget)
            if n == 0 or (hold and seq.total_len - seq.num_cached == 1):  # nothing new to run / held (above)
                continue
            while not self.allocator.can_reserve(seq.id, seq.num_cached + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.allocator.reserve(seq.id, seq.num_cached + n)
            picked.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if self.allocator.prefix_cache:  # token_ids copies the sequence: only where it is read
                seq.num_cached = self.allocator.match(seq.id, seq.token_ids)
            n = min(seq.total_len - seq.num_cached, budget)
            if not self.allocator.can_reserve(seq.id, seq.num_cached + n):
                self.allocator.release(seq.id)  # the matched pages go back idle, still registered
                seq.num_cached = 0
                break
            self.waiting.popleft()
            self.cached_tokens += seq.num_cached
            self.allocator.reserve(seq.id, seq.num_cached + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            picked.append((seq, n))
            budget -= n
        if not picked:
            return None
        return self._build(picked)

    def schedule_spec(self, lookahead: int) -> list[Sequence] | None:
        """The running sequences, if this step can speculate: nothing is waiting to be admitted and
        each sequence has exactly one uncached token (the last sampled one). Reserves
        total_len + lookahead slots per sequence, preempting the newest when out of pages."""
        if not self.running or self.admission_pending():
            return None
        if any(s.total_len - s.num_cached != 1 for s in self.running):
            return None
        picked = []
        for seq in list(self.running):
            if seq not in self.running:
                continue
            need = seq.total_len + lookahead
            while not self.allocator.can_reserve(seq.id, need):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.allocator.reserve(seq.id, need)
                picked.append(seq)
        return picked or None

    def _build(self, picked: list[tuple[Sequence, int]]) -> ScheduledBatch:
        items = [(seq.id, seq.num_cached, seq.num_cached + n) for seq, n in picked]
        ids: list[int] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        row = 0
        for seq, n in picked:
            start, end = seq.num_cached, seq.num_cached + n
            ids.extend(seq.token_ids[start:end])
            row += n
            if end == seq.total_len:  # the chunk reaches the last known token: sample the next one
                sample_rows.append(row - 1)
                samplers.append(seq)
        return ScheduledBatch(
            [s for s, _ in picked], [n for _, n in picked], sample_rows, samplers, items,
            torch.tensor(ids, dtype=torch.long, device=self.device),
        )
