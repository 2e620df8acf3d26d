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

import torch

from headstart.inference.kv_cache import PageAllocator
from headstart.inference.sampler import SamplingParams
from headstart.nn.attention import AttentionMetadata


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "length", "stop" (EOS, stop token or string), "abort"
    text: str = ""  # detokenised output, cut at a stop string
    logprobs: list[dict] = field(default_factory=list)
    num_preemptions: int = 0

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
    meta: AttentionMetadata
    input_ids: torch.Tensor  # (N,)


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_batch_size: int, max_batched_tokens: int,
                 device: torch.device) -> None:
        self.allocator = allocator
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.device = device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.release(seq.id)
        seq.num_cached, seq.status = 0, Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted below to make room for an earlier sequence
                continue
            n = min(seq.total_len - seq.num_cached, budget)
            if n == 0:  # nothing new to run (a caller has not appended its next token yet)
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
            n = min(seq.total_len - seq.num_cached, budget)
            if not self.allocator.can_reserve(seq.id, seq.num_cached + n):
                break
            self.waiting.popleft()
            self.allocator.reserve(seq.id, seq.num_cached + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            picked.append((seq, n))
            budget -= n
        if not picked:
            return None
        return self._build(picked)

    def _build(self, picked: list[tuple[Sequence, int]]) -> ScheduledBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        indptr = [0]
        kv_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        for seq, n in picked:
            start, end = seq.num_cached, seq.num_cached + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self.allocator.slots(seq.id, start, end))
            indptr.append(indptr[-1] + n)
            kv_lens.append(end)
            tables.append(self.allocator.page_table(seq.id))
            if end == seq.total_len:  # the chunk reaches the last known token: sample the next one
                sample_rows.append(indptr[-1] - 1)
                samplers.append(seq)
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for b, t in enumerate(tables):
            table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=dev),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
            page_table=table.to(dev),
            page_size=self.allocator.page_size,
            q_lens_cpu=[n for _, n in picked],
            kv_lens_cpu=kv_lens,
        )
        return ScheduledBatch(
            [s for s, _ in picked], [n for _, n in picked], sample_rows, samplers, meta,
            torch.tensor(ids, dtype=torch.long, device=dev),
        )
