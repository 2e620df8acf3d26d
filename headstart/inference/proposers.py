"""Speculative decoding: proposers (draft model, hidden-state head chains, Medusa, DFlash blocks).

A proposer runs its model through a ModelRunner (its own KV tensors; the page bookkeeping is the
scheduler's allocator, shared with the target: a draft entry for position i lives in the same slot
as the target's); its per-request state (valid draft rows, carried features and logits, the drafting
generator) is `Sequence.draft` and dies with the request. The engine calls, per step:
  absorb(...)   after every target forward, with the target states of the positions it processed,
                so the draft's cache follows the target's (prefill primes it; preemption resets it);
  propose(...)  on decode-only steps: k draft tokens per sequence (and q if drafts were sampled);
  after_verify  with the verdict, to drop rejected draft entries and re-run over the accepted span.

Shift conventions: a head row i is (h_i, t_{i+1}) at position i and predicts t_{i+2}; a draft-model
row i is t_i at position i and predicts t_{i+1}. So with n cached target positions and the pending
token t_n, both have rows 0..n-1 cached: a head's row n-1 is (h_{n-1}, t_n); a draft model runs
t_n itself as the first forward of `propose`, in the slot the speculative step reserved.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from headstart.inference.kv_cache import KVCacheSpec
from headstart.inference.runner import ModelRunner
from headstart.inference.sampler import draw, processed_probs
from headstart.inference.scheduler import DraftState, Sequence
from headstart.inference.speculation import SpecConfig


@dataclass
class Proposal:
    drafts: list[list[int]]  # per sequence, target-vocabulary ids
    q: list[torch.Tensor | None]  # per sequence (k, V) draft distributions when drafts were sampled


def _draft_choice(logits: torch.Tensor, seqs: list[Sequence], sample: bool, generators: list[torch.Generator],
                  to_target: Any) -> tuple[list[int], list[torch.Tensor | None]]:
    """Pick one draft token per row: argmax, or a draw from q (processed like the target's p)."""
    if not sample:
        return to_target(logits.argmax(-1)).tolist(), [None] * len(seqs)
    q = processed_probs(logits, [s.params for s in seqs])  # (B, V_draft)
    ids = draw(q, generators)
    return to_target(ids).tolist(), list(q)


class _Proposer:
    """Shared bookkeeping: the model runner (None for Medusa, which has no cache) and the per-request
    state kept on each Sequence (`seq.draft`)."""

    method: str = ""

    def __init__(self, config: SpecConfig, runner: ModelRunner | None) -> None:
        self.config = config
        self.runner = runner

    def capture(self) -> tuple[int, ...]:
        return ()

    def forget(self, seq: Sequence) -> None:
        seq.draft = DraftState()

    def generators(self, seqs: list[Sequence]) -> list[torch.Generator]:
        for s in seqs:
            if s.draft.generator is None:  # drafting draws must not share the verifier's stream
                g = torch.Generator()
                g.manual_seed(s.seed * 7919 + 104729)
                s.draft.generator = g
        return [s.draft.generator for s in seqs]

    def ready(self, seq: Sequence) -> bool:
        return seq.draft.carry is not None

    def _follow(self, items: list[tuple[Sequence, int, int, list[int]]]) -> None:
        """Before absorbing a target step: a sequence (re)starting at 0 drops its draft state, and the
        draft's cache must end where the step starts."""
        for seq, start, _, _ in items:
            if start == 0:
                self.forget(seq)
            if seq.draft.cached != start:
                raise RuntimeError(f"{seq.id}: the draft cache has {seq.draft.cached} rows but the "
                                   f"target step starts at {start}")

    def _independent_drafts(self, logits: torch.Tensor, seqs: list[Sequence], vocab: int) -> Proposal:
        """Drafts that do not condition on each other (Medusa heads, a DFlash block): logits (B, k, V)
        -> draft j of each sequence from logits[:, j] (argmax, or a draw from its q placed on the
        target vocabulary for the full-q rule)."""
        sample = self.config.draft_sampling and not all(s.params.greedy for s in seqs)
        gens = self.generators(seqs) if sample else []
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(logits.shape[1]):
            choice, q = _draft_choice(logits[:, j], seqs, sample, gens, self.to_target)
            for b, c in enumerate(choice):
                drafts[b].append(c)
                if q[b] is not None:
                    qs[b].append(spread_to_target(q[b], vocab, self.to_target))
        return Proposal(drafts, [torch.stack(q) if q else None for q in qs])


def _identity(ids: torch.Tensor) -> torch.Tensor:
    return ids


class _ChainProposer(_Proposer, abc.ABC):
    """Drafts k tokens one after another: the first from the carried logits, each next one from a
    draft forward over the previous draft token (`_step`)."""

    drafted = 1  # draft tokens of the last proposal (adaptive drafting may stop before k)

    @abc.abstractmethod
    def _step(self, seqs: list[Sequence], j: int, tokens: torch.Tensor) -> torch.Tensor:
        """Feed draft j (B,) through the draft model; return the logits for draft j + 1."""

    def _to_target_dist(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        sample = self.config.draft_sampling and not all(s.params.greedy for s in seqs)
        gens = self.generators(seqs) if sample else []
        logits = torch.cat([s.draft.carry[1] for s in seqs])
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        threshold = self.config.draft_threshold
        for j in range(k):
            choice, q = _draft_choice(logits, seqs, sample, gens, self.to_target)
            for b, c in enumerate(choice):
                drafts[b].append(c)
                if q[b] is not None:
                    qs[b].append(self._to_target_dist(q[b]))
            if j == k - 1:
                break
            # Adaptive length: the batch stops when every draft just made was unsure (one host sync).
            if threshold is not None and float(torch.softmax(logits.float(), -1).amax(-1).max()) < threshold:
                break
            logits = self._step(seqs, j, torch.tensor(choice))
        self.drafted = len(drafts[0])
        return Proposal(drafts, [torch.stack(q) if q else None for q in qs])


class HeadChainProposer(_ChainProposer):
    """mtp / eagle1 / deepseek_mtp / eagle3 heads drafting a chain on their own hidden states."""

    method = "chain"

    def __init__(self, config: SpecConfig, runner: ModelRunner) -> None:
        super().__init__(config, runner)
        self.head = runner.model
        self.to_target = getattr(self.head, "to_target_ids", _identity)
        self._feats: torch.Tensor | None = None

    def capture(self) -> tuple[int, ...]:
        return tuple(self.head.config.aux_layer_ids or ())

    def _features(self, hidden: torch.Tensor, aux: dict[int, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        ids = self.head.config.aux_layer_ids
        stacked = torch.stack([aux[j][rows] for j in ids], dim=1) if ids else None
        return self.head.target_features(hidden[rows], stacked)

    def absorb(self, items: list[tuple[Sequence, int, int, list[int]]], hidden: torch.Tensor,
               aux: dict[int, torch.Tensor]) -> None:
        """items: (seq, start, end, rows): the target computed positions [start, end) of seq, whose
        hidden states are rows `rows` of `hidden`. Head rows start..end-1 are (h_i, t_{i+1})."""
        self._follow(items)
        rows = torch.tensor([r for *_, rs in items for r in rs], device=hidden.device)
        tokens = [t for seq, s, e, _ in items for t in seq.token_ids[s + 1:e + 1]]
        with torch.inference_mode():
            feats = self._features(hidden, aux, rows)
        h, _, meta = self.runner.run(tokens, [(seq.id, s, e) for seq, s, e, _ in items], features=feats)
        last = meta.qo_indptr[1:].long() - 1
        logits = self.runner.logits(h, last)
        for b, (seq, _, e, _) in enumerate(items):
            seq.draft.cached = e
            seq.draft.carry = (h[last[b]].unsqueeze(0), logits[b].unsqueeze(0))

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        self._feats = torch.cat([s.draft.carry[0] for s in seqs])
        return super().propose(seqs, k)

    def _step(self, seqs: list[Sequence], j: int, tokens: torch.Tensor) -> torch.Tensor:
        # Row n + j = (own hidden, d_{j+1}) at position n + j (the pending token t_n sits at n).
        items = [(s.id, s.num_cached + j, s.num_cached + j + 1) for s in seqs]
        self._feats, _, _ = self.runner.run(tokens, items, features=self._feats)
        return self.runner.logits(self._feats)

    def _to_target_dist(self, q: torch.Tensor) -> torch.Tensor:
        return spread_to_target(q, self.head.target.vocab_size, self.to_target)

    def after_verify(self, seq: Sequence, n: int, accepted: int) -> None:
        """Rows n.. used the head's own states: drop them; absorb() re-runs them with the target's."""
        seq.draft.cached = n


class DraftModelProposer(_ChainProposer):
    """A small LM with the target's tokenizer and its own KV cache (draft-target decoding)."""

    method = "draft"
    to_target = staticmethod(_identity)

    def absorb(self, items: list[tuple[Sequence, int, int, list[int]]], hidden: torch.Tensor | None = None,
               aux: dict[int, torch.Tensor] | None = None) -> None:
        """Run the draft over the tokens the target just ran (it reads tokens only; the target states
        are ignored), in the slots the scheduler reserved for them, so the draft's work per step stays
        within the scheduler's token budget and its pages. Rows between the draft's cache and the
        target's step (d_k after a step that accepted every draft) are run first."""
        work = []
        for seq, start, end, _ in items:
            if start == 0:
                self.forget(seq)
            cached = seq.draft.cached
            if not start <= cached <= end:
                raise RuntimeError(f"{seq.id}: the draft cache has {cached} rows but the target step ran "
                                   f"positions {start}..{end - 1}")
            if cached < end:
                work.append((seq, cached, end))
        if not work:
            return
        self.runner.run([t for seq, s, e in work for t in seq.token_ids[s:e]], [(seq.id, s, e) for seq, s, e in work])
        for seq, _, e in work:
            seq.draft.cached = e

    def ready(self, seq: Sequence) -> bool:
        return seq.draft.cached == seq.num_cached

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        # The pending token t_n goes first, at position n, in the slot the speculative step reserved.
        h, _, _ = self.runner.run([s.token_ids[-1] for s in seqs], [(s.id, s.num_cached, s.num_cached + 1)
                                                                      for s in seqs])
        logits = self.runner.logits(h)
        for b, s in enumerate(seqs):
            s.draft.carry = (torch.zeros(0), logits[b].unsqueeze(0))
        return super().propose(seqs, k)

    def _step(self, seqs: list[Sequence], j: int, tokens: torch.Tensor) -> torch.Tensor:
        # Draft j + 1 goes to position n + 1 + j (t_n sits at n = num_cached).
        h, _, _ = self.runner.run(tokens, [(s.id, s.num_cached + 1 + j, s.num_cached + 2 + j) for s in seqs])
        return self.runner.logits(h)

    def after_verify(self, seq: Sequence, n: int, accepted: int) -> None:
        """t_n and drafts d_1..d_{k-1} were fed at positions n..n+k-1; the accepted ones stay valid
        (d_k, never fed, is run by the next absorb)."""
        seq.draft.cached = n + 1 + min(accepted, self.drafted - 1)
        seq.draft.carry = None


class MedusaProposer(_Proposer):
    """k Medusa heads read the target's last hidden state; no KV cache."""

    method = "medusa"

    def __init__(self, config: SpecConfig, head: Any) -> None:
        super().__init__(config, None)
        if config.k > head.config.medusa_num_heads:
            raise ValueError(f"k={config.k} exceeds the Medusa head count {head.config.medusa_num_heads}")
        self.head = head
        self.to_target = head.to_target_ids if head.lm_head is not None else _identity

    def absorb(self, items: list[tuple[Sequence, int, int, list[int]]], hidden: torch.Tensor,
               aux: dict[int, torch.Tensor]) -> None:
        for seq, _, end, rows in items:
            seq.draft.cached = end
            seq.draft.carry = (hidden[rows[-1]].unsqueeze(0), torch.zeros(0))

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        with torch.inference_mode():
            feats = self.head.target_features(torch.cat([s.draft.carry[0] for s in seqs]))
            _, logits = self.head.draft_step(None, feats)  # (B, heads, V)
        return self._independent_drafts(logits[:, :k], seqs, self.head.target.vocab_size)  # head j drafts t_{n+j+1}

    def after_verify(self, seq: Sequence, n: int, accepted: int) -> None:
        seq.draft.cached = n


class BlockProposer(_Proposer):
    """A DFlash head: the context K/V of every verified position is written into its cache from the
    target's fused states (absorb), and each step runs one block [t_n, m, ..., m] of the head's
    block_size positions n..n+bs-1, attending to the context and to the whole block; slot j drafts
    d_j for j <= k. The block is the trained one whatever k: a shorter one changes what each mask
    position attends to. Its K/V go to the bs slots the speculative step reserved (SpecConfig's
    lookahead), the sequence's own, above its verified length. Drafts are conditionally independent
    given the context, so a sampled d_j is drawn from slot j's q alone and the full-q rule stays exact."""

    method = "block"

    def __init__(self, config: SpecConfig, runner: ModelRunner) -> None:
        super().__init__(config, runner)
        self.head = runner.model
        bs = self.head.block_size
        if config.k > bs - 1:
            raise ValueError(f"k={config.k} exceeds the drafts a dflash block of {bs} positions "
                             f"holds ({bs - 1}): use k <= {bs - 1}")
        if config.lookahead < bs:
            raise ValueError(f"a dflash block runs {bs} positions but the step reserves {config.lookahead} "
                             "slots: give SpecConfig the resolved head (the engine does)")
        self.to_target = self.head.to_target_ids

    def capture(self) -> tuple[int, ...]:
        return tuple(self.head.config.aux_layer_ids)

    def absorb(self, items: list[tuple[Sequence, int, int, list[int]]], hidden: torch.Tensor,
               aux: dict[int, torch.Tensor]) -> None:
        """Context K/V for the positions [start, end) the target just computed (rows of `aux`)."""
        self._follow(items)
        rows = torch.tensor([r for *_, rs in items for r in rs], device=hidden.device)
        with torch.inference_mode():
            states = self.head.target_features(None, torch.stack([aux[j][rows] for j in self.capture()], dim=1))
        self.runner.write_context([(seq.id, s, e) for seq, s, e, _ in items], states)
        for seq, _, e, _ in items:
            seq.draft.cached = e

    def ready(self, seq: Sequence) -> bool:
        return seq.draft.cached == seq.num_cached

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        bs, n = self.head.block_size, [s.num_cached for s in seqs]
        tokens = self.head.block_tokens([s.token_ids[-1] for s in seqs], bs)
        masks = [torch.ones(bs, m + bs, dtype=torch.bool) for m in n]  # the context and the whole block
        h, _, _ = self.runner.run(tokens, [(s.id, m, m + bs) for s, m in zip(seqs, n)], masks=masks)
        rows = (torch.arange(len(seqs))[:, None] * bs + torch.arange(1, k + 1)).reshape(-1)  # slots 1..k
        logits = self.runner.logits(h, rows).view(len(seqs), k, -1)  # slot j drafts d_j
        return self._independent_drafts(logits, seqs, self.head.target.vocab_size)

    def after_verify(self, seq: Sequence, n: int, accepted: int) -> None:
        """The block's K/V at n.. are not context: absorb() writes the verified positions over them,
        and the slots past the verified ones are never read before it does."""
        seq.draft.cached = n


def spread_to_target(q: torch.Tensor, vocab: int, to_target: Any) -> torch.Tensor:
    """A q over a reduced draft vocabulary (eagle3, Medusa) placed on the target vocabulary, as the
    full-q rule compares it with p token by token."""
    if q.numel() == vocab:
        return q
    full = torch.zeros(vocab, dtype=q.dtype, device=q.device)
    full[to_target(torch.arange(q.numel(), device=q.device))] = q
    return full


def draft_kv_spec(draft: Any) -> KVCacheSpec | None:
    """The KV cache shape a proposer's model needs (None for Medusa, which has no cache)."""
    from headstart.models.base import CausalLM

    if isinstance(draft, CausalLM):  # a draft model of any target family
        return KVCacheSpec.of(draft)
    if draft.kv_layers() == 0:
        return None
    return KVCacheSpec(num_layers=draft.kv_layers(), num_kv_heads=draft.cache_heads, head_dim=draft.cache_head_dim,
                       dtype=draft.dtype, shared=draft.cache_shared)
