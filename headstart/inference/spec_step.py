"""The speculative half of the engine's step: resolve the proposer's model, decide when a step can
speculate, draft, verify (chain rules batched on the device, or the EAGLE-2 tree rule), commit the
accepted tokens and keep the proposer's cache in step with the target's.

`Engine` builds one `SpeculativeStep` when it speculates and calls `ready` / `step` / `absorb_normal`;
the step reads the engine's parts through `EngineParts` (the runner, scheduler, proposer, metrics and two
callbacks), read at each call, so a caller that swaps the engine's proposer or metrics is followed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import torch

from headstart.inference.outputs import EngineStats, RequestOutput
from headstart.inference.rejection import Verdict, verify_chain, verify_greedy, verify_tree
from headstart.inference.runner import ModelRunner
from headstart.inference.sampler import processed_probs, rows_logprobs
from headstart.inference.scheduler import ScheduledBatch, Scheduler, Sequence, Status
from headstart.inference.speculation import SpecConfig, SpecMetrics, heads_for
from headstart.inference.tree import TreeProposer
from headstart.models import CausalLM, load_target


def resolve_draft(spec: SpecConfig, target: CausalLM, dtype: str, device: torch.device) -> Any:
    """The proposer's model: a head (chain / medusa) or a draft LM, loaded if given as a path."""
    from headstart.heads import DraftHead, DraftLM, is_head_checkpoint, load_head

    if spec.method in ("chain", "medusa", "tree", "block"):
        head = spec.head
        if head is None:
            raise ValueError(f"--spec {spec.method} needs a head (a checkpoint directory)")
        if not isinstance(head, DraftHead):
            head = load_head(head, target, allow_other_target=spec.allow_other_target)
        kinds = heads_for(spec.method)
        if head.config.head_type not in kinds:
            raise ValueError(f"--spec {spec.method} cannot use a {head.config.head_type!r} head "
                             f"(it takes {', '.join(kinds)})")
        return head
    draft = spec.draft
    if draft is None:
        raise ValueError("--spec draft needs a draft model (--draft NAME_OR_DIR or a DraftLM head)")
    if isinstance(draft, (str, Path)):
        from headstart.assets import resolve_model

        path = Path(str(draft))
        if is_head_checkpoint(path):
            head = load_head(path, target, allow_other_target=spec.allow_other_target)
            if not isinstance(head, DraftLM):
                raise ValueError(f"{path}: a {head.config.head_type!r} head is not a draft model")
            return head
        draft = load_target(resolve_model(str(draft)), dtype=dtype, device=device)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft's vocab_size {draft.config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size}: they must share a tokenizer")
    if not isinstance(draft, DraftLM | CausalLM):
        raise TypeError(f"a draft model must be a DraftLM head or a target model, got {type(draft).__name__}")
    return draft


class EngineParts(Protocol):
    """What a speculative step reads of its engine (Engine sets each in its constructor)."""

    model: CausalLM  # the target
    device: torch.device
    scheduler: Scheduler  # the only owner of the page allocator
    runner: ModelRunner  # the target's runner
    spec: SpecConfig
    proposer: Any  # a proposer of headstart.inference.proposers (or the tree proposer)
    spec_metrics: SpecMetrics
    stats: EngineStats
    max_model_len: int

    def _check_stop(self, seq: Sequence, tok: int) -> None: ...  # finish on EOS, a stop string or the length

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput: ...  # the output for the tokens just emitted


class SpeculativeStep:
    """A decode step that drafts, verifies every draft in one target forward and commits the accepted
    tokens; and, after a plain step, the proposer catching up with the target."""

    def __init__(self, engine: EngineParts) -> None:
        self.engine = engine

    def ready(self) -> list[Sequence] | None:
        sched, look = self.engine.scheduler, self.engine.spec.lookahead
        if not sched.running or sched.admission_pending():
            return None
        for s in sched.running:
            if s.total_len - s.num_cached != 1 or not self.engine.proposer.ready(s):
                return None
            if s.total_len + look > self.engine.max_model_len:
                return None
        return sched.schedule_spec(lookahead=look)

    def step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        if isinstance(self.engine.proposer, TreeProposer):
            return self._tree_step(seqs)
        t0 = time.perf_counter()
        proposal = self.engine.proposer.propose(seqs, self.engine.spec.k)
        t1 = time.perf_counter()
        k = len(proposal.drafts[0])  # this step's draft length (adaptive drafting / n-gram: 1..spec.k)
        items = [(s.id, s.num_cached, s.num_cached + k + 1) for s in seqs]
        ids = [t for s, d in zip(seqs, proposal.drafts) for t in [s.token_ids[-1]] + d]
        h, aux, _ = self.engine.runner.run(ids, items, capture=self.engine.proposer.capture())
        logits = self.engine.runner.logits(h)  # (B * (k+1), V)
        params = [s.params for s in seqs for _ in range(k + 1)]
        histories = None
        if any(p.repetition_penalty != 1.0 for p in params):
            histories = [s.token_ids + d[:j] for s, d in zip(seqs, proposal.drafts) for j in range(k + 1)]
        if histories is None and all(s.params.greedy for s in seqs):  # argmaxes only: one host sync
            best = logits.argmax(-1).tolist()
            verdicts = [verify_greedy(d, best[b * (k + 1):(b + 1) * (k + 1)]) for b, d in enumerate(proposal.drafts)]
        else:
            verdicts = self._verify_batch(seqs, proposal, processed_probs(logits, params, histories), k)
        outputs, absorb = [], []
        for b, (seq, verdict) in enumerate(zip(seqs, verdicts)):
            n, a = seq.num_cached, verdict.accepted
            seq.spec_metrics.add(a, k)
            self.engine.spec_metrics.add(a, k)
            rows = list(range(b * (k + 1), b * (k + 1) + a + 1))  # the rows whose logits gave each token
            outputs.append(self._commit(seq, n, a, verdict.tokens, rows_logprobs(seq.params, logits, rows,
                                                                                 verdict.tokens)))
            if seq.status is not Status.FINISHED:
                absorb.append((seq, n, n + a + 1, rows))
        return self._finish(outputs, absorb, h, aux, t0, t1)

    def _verify_batch(self, seqs: list[Sequence], proposal: Any, p: torch.Tensor, k: int) -> list[Verdict]:
        """Sampled (or mixed) verification of every sequence at once on the logits' device: k + 1
        uniforms per sampling request from its own generator, the rules as tensor ops, one host sync."""
        b = len(seqs)
        u = torch.stack([torch.rand(k + 1, generator=s.generator, dtype=torch.float64) if not s.params.greedy
                         else torch.zeros(k + 1, dtype=torch.float64) for s in seqs]).to(p.device)
        q = torch.stack(proposal.q).to(p.device) if all(x is not None for x in proposal.q) else None
        drafts = torch.tensor(proposal.drafts, dtype=torch.long, device=p.device)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=p.device)
        a, tokens, ok = verify_chain(drafts, p.view(b, k + 1, -1), q, u, greedy)
        table = torch.cat([a.unsqueeze(1), ok.long().unsqueeze(1), tokens], 1).tolist()  # the one host sync
        out = []
        for seq, (acc, good, *toks) in zip(seqs, table):
            if not good:
                raise ValueError(f"request {seq.id}: cannot sample: the distribution has no positive finite "
                                 "probability (all zero or NaN); check the sampling parameters and the logits")
            out.append(Verdict(acc, toks[:acc + 1]))
        return out

    def _tree_step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """EAGLE-2: draft a tree per sequence, verify every node in one target pass under a tree mask,
        accept a path with the tree rule, then move the path's K/V to contiguous positions."""
        t0 = time.perf_counter()
        trees = self.engine.proposer.propose_trees(seqs)
        t1 = time.perf_counter()
        items, masks, positions, ids = [], [], [], []
        for s, tree in zip(seqs, trees):
            n, m = s.num_cached, len(tree.tokens)
            items.append((s.id, n, n + m))
            masks.append(tree.mask(n))
            positions.append([n + d for d in tree.depths])
            ids.extend(tree.tokens)
        h, aux, _ = self.engine.runner.run(ids, items, capture=self.engine.proposer.capture(), masks=masks,
                                           positions=positions)
        logits = self.engine.runner.logits(h)
        params = [s.params for s, t in zip(seqs, trees) for _ in t.tokens]
        histories = None
        if any(p.repetition_penalty != 1.0 for p in params):
            histories = [s.token_ids + [t.tokens[a] for a in t.ancestors(i)] for s, t in zip(seqs, trees)
                         for i in range(len(t.tokens))]
        p = processed_probs(logits, params, histories)
        outputs, absorb, row = [], [], 0
        for seq, tree in zip(seqs, trees):
            n, m = seq.num_cached, len(tree.tokens)
            path, emitted = verify_tree(tree.children, tree.tokens, p[row:row + m], seq.params.greedy, seq.generator)
            a = len(path)
            seq.spec_metrics.add(a, m - 1)
            self.engine.spec_metrics.add(a, m - 1)
            # Compaction: node j of the path moves from KV index n + node to n + j + 1.
            self.engine.runner.move_kv(seq.id, [n + node for node in path], list(range(n + 1, n + a + 1)))
            rows = [row] + [row + node for node in path]
            outputs.append(self._commit(seq, n, a, emitted, rows_logprobs(seq.params, logits, rows, emitted)))
            if seq.status is not Status.FINISHED:
                absorb.append((seq, n, n + a + 1, rows))
            row += m
        return self._finish(outputs, absorb, h, aux, t0, t1)

    def _finish(self, outputs: list[RequestOutput], absorb: list, h: torch.Tensor,
                          aux: dict[int, torch.Tensor], t0: float, t1: float) -> list[RequestOutput]:
        """Re-run the draft over the accepted spans and book the step's draft / verify time."""
        t2 = time.perf_counter()
        if absorb:
            self.engine.proposer.absorb(absorb, h, aux)
        t3 = time.perf_counter()
        self.engine.spec_metrics.draft_seconds += (t1 - t0) + (t3 - t2)
        self.engine.spec_metrics.verify_seconds += t2 - t1
        self.engine.stats.decode_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def _commit(self, seq: Sequence, n: int, a: int, tokens: list[int],
                logprobs: list[dict] | None = None) -> RequestOutput:
        """After verification: keep the pending token and the a accepted drafts in the caches, drop
        the rest, emit the tokens (up to a stop condition) with their log-probabilities if asked."""
        seq.num_cached = n + 1 + a
        self.engine.scheduler.truncate(seq)
        self.engine.proposer.after_verify(seq, n, a)
        new = []
        for i, tok in enumerate(tokens):
            seq.output_ids.append(tok)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            new.append(tok)
            self.engine._check_stop(seq, tok)
            if seq.status is Status.FINISHED:
                self.engine.proposer.forget(seq)
                break
        return self.engine._output(seq, new)

    def absorb_normal(self, batch: ScheduledBatch, h: torch.Tensor, aux: dict[int, torch.Tensor]) -> None:
        """After a normal step: bring the draft's cache up to the target's for every live sequence."""
        items, row = [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_cached - n
            if seq.status is Status.FINISHED or start == 0:
                # Finished, or (re)prefilled from scratch after a preemption released its pages.
                self.engine.proposer.forget(seq)
            if seq.status is not Status.FINISHED:
                items.append((seq, start, seq.num_cached, list(range(row, row + n))))
            row += n
        if items:
            self.engine.proposer.absorb(items, h, aux)
