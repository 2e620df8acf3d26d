"""The speculative half of the engine's step: resolve the proposer's model, decide when a step can
speculate, draft, verify (chain rules batched on the device, or the EAGLE-2 tree rule), commit the
accepted tokens and keep the proposer's cache in step with the target's.

`Engine` inherits these methods; they use its runner, scheduler, proposer and metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headstart.inference.proposers import SpecConfig, SpecMetrics
from headstart.inference.rejection import Verdict, verify_chain, verify_greedy, verify_tree
from headstart.inference.runner import ModelRunner
from headstart.inference.sampler import processed_probs, rows_logprobs
from headstart.inference.scheduler import ScheduledBatch, Scheduler, Sequence, Status
from headstart.inference.tree import TreeProposer
from headstart.models import CausalLM, load_target

if TYPE_CHECKING:
    from headstart.inference.engine import EngineStats, RequestOutput


class SpeculativeSteps:
    """Mixin for Engine: everything a speculative step does beyond a plain one.

    Its contract with the engine is the attributes annotated below (Engine.__init__ sets each, and
    defines the two methods); it reaches for nothing else."""

    model: CausalLM  # the target
    device: torch.device
    scheduler: Scheduler  # the only owner of the page allocator
    runner: ModelRunner  # the target's runner
    spec: SpecConfig | None
    proposer: Any  # a proposer of headstart.inference.proposers (or the tree proposer)
    spec_metrics: SpecMetrics
    stats: EngineStats
    max_model_len: int
    _check_stop: Callable[[Sequence, int], None]  # Engine: finish a sequence on EOS, a stop string or its length
    _output: Callable[[Sequence, list[int]], RequestOutput]  # Engine: the output for the tokens just emitted

    def _resolve_draft(self, spec: SpecConfig, dtype: str) -> Any:
        """The proposer's model: a head (chain / medusa) or a draft LM, loaded if given as a path."""
        from headstart.heads import DraftHead, DraftLM, is_head_checkpoint, load_head

        if spec.method in ("chain", "medusa", "tree", "block"):
            head = spec.head
            if head is None:
                raise ValueError(f"--spec {spec.method} needs a head (a checkpoint directory)")
            if not isinstance(head, DraftHead):
                head = load_head(head, self.model, allow_other_target=spec.allow_other_target)
            kinds = {"medusa": ("medusa",), "block": ("dflash",)}.get(spec.method,
                                                                        ("mtp", "eagle1", "deepseek_mtp", "eagle3"))
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
                head = load_head(path, self.model, allow_other_target=spec.allow_other_target)
                if not isinstance(head, DraftLM):
                    raise ValueError(f"{path}: a {head.config.head_type!r} head is not a draft model")
                return head
            draft = load_target(resolve_model(str(draft)), dtype=dtype, device=self.device)
            if draft.config.vocab_size != self.model.config.vocab_size:
                raise ValueError(f"the draft's vocab_size {draft.config.vocab_size} differs from the target's "
                                 f"{self.model.config.vocab_size}: they must share a tokenizer")
        if not isinstance(draft, DraftLM | CausalLM):
            raise TypeError(f"a draft model must be a DraftLM head or a target model, got {type(draft).__name__}")
        return draft

    def _spec_ready(self) -> list[Sequence] | None:
        sched, look = self.scheduler, self.spec.lookahead
        if not sched.running or (sched.waiting and len(sched.running) < sched.max_batch_size):
            return None
        for s in sched.running:
            if s.total_len - s.num_cached != 1 or not self.proposer.ready(s):
                return None
            if s.total_len + look > self.max_model_len:
                return None
        return sched.schedule_spec(lookahead=look)

    def _spec_step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        if isinstance(self.proposer, TreeProposer):
            return self._tree_step(seqs)
        t0 = time.perf_counter()
        proposal = self.proposer.propose(seqs, self.spec.k)
        t1 = time.perf_counter()
        k = len(proposal.drafts[0])  # this step's draft length (adaptive drafting / n-gram: 1..spec.k)
        items = [(s.id, s.num_cached, s.num_cached + k + 1) for s in seqs]
        ids = [t for s, d in zip(seqs, proposal.drafts) for t in [s.token_ids[-1]] + d]
        h, aux, _ = self.runner.run(ids, items, capture=self.proposer.capture())
        logits = self.runner.logits(h)  # (B * (k+1), V)
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
            self.spec_metrics.add(a, k)
            rows = list(range(b * (k + 1), b * (k + 1) + a + 1))  # the rows whose logits gave each token
            outputs.append(self._commit(seq, n, a, verdict.tokens, rows_logprobs(seq.params, logits, rows,
                                                                                 verdict.tokens)))
            if seq.status is not Status.FINISHED:
                absorb.append((seq, n, n + a + 1, rows))
        return self._finish_spec_step(outputs, absorb, h, aux, t0, t1)

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
        trees = self.proposer.propose_trees(seqs)
        t1 = time.perf_counter()
        items, masks, positions, ids = [], [], [], []
        for s, tree in zip(seqs, trees):
            n, m = s.num_cached, len(tree.tokens)
            items.append((s.id, n, n + m))
            masks.append(tree.mask(n))
            positions.append([n + d for d in tree.depths])
            ids.extend(tree.tokens)
        h, aux, _ = self.runner.run(ids, items, capture=self.proposer.capture(), masks=masks, positions=positions)
        logits = self.runner.logits(h)
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
            self.spec_metrics.add(a, m - 1)
            # Compaction: node j of the path moves from KV index n + node to n + j + 1.
            self.runner.move_kv(seq.id, [n + node for node in path], list(range(n + 1, n + a + 1)))
            rows = [row] + [row + node for node in path]
            outputs.append(self._commit(seq, n, a, emitted, rows_logprobs(seq.params, logits, rows, emitted)))
            if seq.status is not Status.FINISHED:
                absorb.append((seq, n, n + a + 1, rows))
            row += m
        return self._finish_spec_step(outputs, absorb, h, aux, t0, t1)

    def _finish_spec_step(self, outputs: list[RequestOutput], absorb: list, h: torch.Tensor,
                          aux: dict[int, torch.Tensor], t0: float, t1: float) -> list[RequestOutput]:
        """Re-run the draft over the accepted spans and book the step's draft / verify time."""
        t2 = time.perf_counter()
        if absorb:
            self.proposer.absorb(absorb, h, aux)
        t3 = time.perf_counter()
        self.spec_metrics.draft_seconds += (t1 - t0) + (t3 - t2)
        self.spec_metrics.verify_seconds += t2 - t1
        self.stats.decode_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def _commit(self, seq: Sequence, n: int, a: int, tokens: list[int],
                logprobs: list[dict] | None = None) -> RequestOutput:
        """After verification: keep the pending token and the a accepted drafts in the caches, drop
        the rest, emit the tokens (up to a stop condition) with their log-probabilities if asked."""
        seq.num_cached = n + 1 + a
        self.scheduler.truncate(seq)
        self.proposer.after_verify(seq, n, a)
        new = []
        for i, tok in enumerate(tokens):
            seq.output_ids.append(tok)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            new.append(tok)
            self._check_stop(seq, tok)
            if seq.status is Status.FINISHED:
                self.proposer.forget(seq)
                break
        return self._output(seq, new)

    def _absorb_normal(self, batch: ScheduledBatch, h: torch.Tensor, aux: dict[int, torch.Tensor]) -> None:
        """After a normal step: bring the draft's cache up to the target's for every live sequence."""
        items, row = [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_cached - n
            if seq.status is Status.FINISHED or start == 0:
                # Finished, or (re)prefilled from scratch after a preemption released its pages.
                self.proposer.forget(seq)
            if seq.status is not Status.FINISHED:
                items.append((seq, start, seq.num_cached, list(range(row, row + n))))
            row += n
        if items:
            self.proposer.absorb(items, h, aux)
