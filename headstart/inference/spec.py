"""Speculative decoding: proposers (draft model, hidden-state head chains, Medusa) and metrics.

A proposer owns the draft's KV tensors (the page bookkeeping is the engine's allocator, shared with
the target: a draft entry for position i lives in the same slot as the target's) and per-sequence
carried state. The engine calls, per step:
  absorb(...)   after every target forward, with the target states of the positions it processed,
                so the draft's cache follows the target's (prefill primes it; preemption resets it);
  propose(...)  on decode-only steps: k draft tokens per sequence (and q if drafts were sampled);
  after_verify  with the verdict, to drop rejected draft entries and re-run over the accepted span.

Shift conventions: a head row i is (h_i, t_{i+1}) at position i and predicts t_{i+2}; a draft-model
row i is t_i at position i and predicts t_{i+1}. So with n cached target positions and the pending
token t_n, a head has rows 0..n-1 cached, a draft model rows 0..n.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator
from headstart.inference.sampler import processed_probs
from headstart.inference.scheduler import Sequence, build_metadata

SpecMethod = Literal["chain", "draft", "medusa", "tree"]


@dataclass(kw_only=True)
class SpecConfig:
    method: SpecMethod
    k: int = 3  # draft tokens per step (Medusa: at most its number of heads)
    head: Any = None  # a DraftHead (chain: mtp/eagle1/deepseek_mtp/eagle3; medusa), or a checkpoint dir
    draft: Any = None  # method "draft": a DraftLM head, a LlamaForCausalLM, or a model name / directory
    draft_sampling: bool = False  # sample drafts from q and verify with the full-q rule (else argmax + one-hot)
    tree_topk: int = 4  # tree: children per expanded node, and nodes expanded per depth
    tree_tokens: int = 16  # tree: draft tokens kept after reranking (verified in one pass); k is the depth

    def __post_init__(self) -> None:
        if self.method not in ("chain", "draft", "medusa", "tree"):
            raise ValueError(f"unknown speculation method {self.method!r}; choose chain, draft, medusa or tree")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.method == "tree" and (self.tree_topk < 1 or self.tree_tokens < 1):
            raise ValueError("tree_topk and tree_tokens must be >= 1")

    @property
    def lookahead(self) -> int:
        """KV slots reserved beyond the sequence for one speculative step."""
        if self.method == "tree":
            return 1 + max(self.tree_tokens, self.tree_topk * self.k)
        return self.k + 1


@dataclass
class SpecMetrics:
    """Acceptance metrics with the names of DESIGN.md §1 (accepted counts exclude the bonus)."""

    accepted: list[int] = field(default_factory=list)  # a per verify step
    drafted: list[int] = field(default_factory=list)  # d per verify step (tree: nodes verified)
    positions: int | None = None  # longest acceptable run (tree: its depth); default: max drafted
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def add(self, a: int, d: int) -> None:
        self.accepted.append(a)
        self.drafted.append(d)

    def merge(self, other: SpecMetrics) -> None:
        self.accepted += other.accepted
        self.drafted += other.drafted
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds

    def summary(self) -> dict[str, Any]:
        n = len(self.accepted)
        k = self.positions or max(self.drafted, default=0)
        if n == 0:
            return {"steps": 0, "tau": None, "alpha": None, "accept_rate_per_pos": [], "cond_accept_per_pos": [],
                    "accept_histogram": []}
        rate = [sum(a >= i + 1 for a in self.accepted) / n for i in range(k)]
        cond = [rate[0]] + [rate[i] / rate[i - 1] if rate[i - 1] else 0.0 for i in range(1, k)] if k else []
        hist = [sum(a == j for a in self.accepted) for j in range(k + 1)]
        return {
            "steps": n,
            "tau": 1 + sum(self.accepted) / n,
            "alpha": sum(self.accepted) / max(1, sum(self.drafted)),
            "accept_rate_per_pos": rate,
            "cond_accept_per_pos": cond,
            "accept_histogram": hist,
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
        }


@dataclass
class Proposal:
    drafts: list[list[int]]  # per sequence, target-vocabulary ids
    q: list[torch.Tensor | None]  # per sequence (k, V) draft distributions when drafts were sampled


def _draft_choice(logits: torch.Tensor, seqs: list[Sequence], sample: bool, generators: dict[str, torch.Generator],
                  to_target: Any) -> tuple[list[int], list[torch.Tensor | None]]:
    """Pick one draft token per row: argmax, or a draw from q (processed like the target's p)."""
    if not sample:
        ids = to_target(logits.argmax(-1))
        return ids.tolist(), [None] * len(seqs)
    q = processed_probs(logits, [s.params for s in seqs])  # (B, V_draft)
    out, qs = [], []
    for b, s in enumerate(seqs):
        g = generators[s.id]
        cdf = q[b].double().cumsum(0)
        u = float(torch.rand((), generator=g, dtype=torch.float64)) * float(cdf[-1])
        j = min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0]),
                int(torch.nonzero(q[b] > 0)[-1]))
        out.append(int(to_target(torch.tensor([j]))[0]))
        qs.append(q[b])
    return out, qs


class _Proposer:
    """Shared bookkeeping: the draft KV cache, per-sequence carried state, draft-sampling generators."""

    method: str = ""

    def __init__(self, config: SpecConfig, allocator: PageAllocator, device: torch.device,
                 kv_spec: KVCacheSpec | None) -> None:
        self.config = config
        self.allocator = allocator
        self.device = device
        self.cache = KVCache(kv_spec, allocator.num_pages, allocator.page_size, device) if kv_spec else None
        self.cached: dict[str, int] = {}  # rows of the draft cache that are valid, per sequence
        self.carry: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (features, logits) of the last row
        self._gens: dict[str, torch.Generator] = {}

    def capture(self) -> tuple[int, ...]:
        return ()

    def forget(self, seq_id: str) -> None:
        self.cached.pop(seq_id, None)
        self.carry.pop(seq_id, None)
        self._gens.pop(seq_id, None)

    def generators(self, seqs: list[Sequence]) -> dict[str, torch.Generator]:
        for s in seqs:
            if s.id not in self._gens:  # drafting draws must not share the verifier's stream
                g = torch.Generator()
                g.manual_seed((s.params.seed or 0) * 7919 + 104729 + len(s.prompt_ids))
                self._gens[s.id] = g
        return self._gens

    def ready(self, seq: Sequence) -> bool:
        return seq.id in self.carry


class HeadChainProposer(_Proposer):
    """mtp / eagle1 / deepseek_mtp / eagle3 heads drafting a chain on their own hidden states."""

    method = "chain"

    def __init__(self, config: SpecConfig, head: Any, allocator: PageAllocator, device: torch.device,
                 backend: Any) -> None:
        cfg = head.config
        spec = KVCacheSpec(num_layers=head.kv_layers(), num_kv_heads=cfg.num_key_value_heads,
                           head_dim=cfg.head_dim, dtype=head.target.embed.weight.dtype)
        super().__init__(config, allocator, device, spec)
        self.head = head
        self.backend = backend
        to_target = getattr(head, "to_target_ids", None)
        self.to_target = to_target if to_target is not None else (lambda ids: ids)

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
        work = []
        for seq, start, end, first in items:
            if start == 0:
                self.forget(seq.id)
            if self.cached.get(seq.id, 0) != start:
                raise RuntimeError(f"{seq.id}: the head cache has {self.cached.get(seq.id, 0)} rows but the "
                                   f"target step starts at {start}")
            work.append((seq, start, end, first))
        if not work:
            return
        rows = torch.tensor([r for *_, rs in work for r in rs], device=hidden.device)
        tokens = torch.tensor([t for seq, s, e, _ in work for t in seq.token_ids[s + 1:e + 1]], device=self.device)
        feats = self._features(hidden, aux, rows)
        meta = build_metadata(self.allocator, [(seq.id, s, e) for seq, s, e, _ in work], self.device)
        with torch.inference_mode():
            self._plan(meta)
            h = self.head.forward_hidden(tokens, feats, meta, self.cache.layers, self.backend)
            last = torch.tensor(meta.qo_indptr[1:].tolist(), device=self.device) - 1
            logits_all = self.head.compute_logits(h[last])
        for b, (seq, _, e, _) in enumerate(work):
            self.cached[seq.id] = e
            self.carry[seq.id] = (h[last[b]].unsqueeze(0), logits_all[b].unsqueeze(0))

    def _plan(self, meta: Any) -> None:
        cfg = self.head.config
        self.backend.plan(meta, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                          self.head.target.embed.weight.dtype)

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        sample = self.config.draft_sampling
        gens = self.generators(seqs) if sample else {}
        feats = torch.cat([self.carry[s.id][0] for s in seqs])
        logits = torch.cat([self.carry[s.id][1] for s in seqs])
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        n = [s.num_cached for s in seqs]  # the pending token t_n sits at position n
        for j in range(k):
            choice, q = _draft_choice(logits, seqs, sample and not all(s.params.greedy for s in seqs), gens,
                                      self.to_target)
            for b, c in enumerate(choice):
                drafts[b].append(c)
                if q[b] is not None:
                    qs[b].append(self._to_target_dist(q[b]))
            if j == k - 1:
                break
            # Row n + j = (own hidden, d_{j+1}) at position n + j, predicting d_{j+2}.
            meta = build_metadata(self.allocator, [(s.id, n[b] + j, n[b] + j + 1) for b, s in enumerate(seqs)],
                                  self.device)
            tokens = torch.tensor([d[-1] for d in drafts], device=self.device)
            with torch.inference_mode():
                self._plan(meta)
                feats = self.head.forward_hidden(tokens, feats, meta, self.cache.layers, self.backend)
                logits = self.head.compute_logits(feats)
        return Proposal(drafts, [torch.stack(q) if q else None for q in qs])

    def _to_target_dist(self, q: torch.Tensor) -> torch.Tensor:
        t2d = getattr(self.head, "t2d", None)
        vocab = self.head.target.lm_head.weight.shape[0]
        if q.numel() == vocab:
            return q
        full = torch.zeros(vocab, dtype=q.dtype, device=q.device)
        full[self.to_target(torch.arange(q.numel(), device=q.device))] = q
        assert t2d is None or int(t2d.sum()) == q.numel()
        return full

    def after_verify(self, seq: Sequence, n: int, accepted: int) -> None:
        """Rows n.. used the head's own states: drop them; absorb() re-runs them with the target's."""
        self.cached[seq.id] = n


class DraftModelProposer(_Proposer):
    """A small LM with the target's tokenizer and its own KV cache (draft-target decoding)."""

    method = "draft"

    def __init__(self, config: SpecConfig, draft: Any, allocator: PageAllocator, device: torch.device,
                 backend: Any) -> None:
        self.forward_fn, self.logits_fn, spec = _draft_model_fns(draft)
        super().__init__(config, allocator, device, spec)
        self.draft = draft
        self.backend = backend
        self.seen_valid: dict[str, int] = {}

    def absorb(self, seqs: list[Sequence], limit: dict[str, int] | None = None) -> None:
        """Run the draft over every known token it has not seen (up to `limit` per sequence)."""
        work = []
        for seq in seqs:
            start = self.cached.get(seq.id, 0)
            if seq.num_cached == 0 and start:  # preempted and recomputing: start over
                self.forget(seq.id)
                start = 0
            end = seq.total_len if limit is None else min(seq.total_len, limit[seq.id])
            if end <= start:
                continue
            if not self.allocator.can_reserve(seq.id, end):
                continue  # catch up at a later step
            self.allocator.reserve(seq.id, end)
            work.append((seq, start, end))
        if not work:
            return
        tokens = torch.tensor([t for seq, s, e in work for t in seq.token_ids[s:e]], device=self.device)
        meta = build_metadata(self.allocator, [(seq.id, s, e) for seq, s, e in work], self.device)
        with torch.inference_mode():
            h = self.forward_fn(tokens, meta, self.cache.layers, self.backend)
            last = torch.tensor(meta.qo_indptr[1:].tolist(), device=self.device) - 1
            logits = self.logits_fn(h[last])
        for b, (seq, _, e) in enumerate(work):
            self.cached[seq.id] = e
            self.carry[seq.id] = (torch.zeros(0), logits[b].unsqueeze(0))

    def ready(self, seq: Sequence) -> bool:
        return self.cached.get(seq.id) == seq.total_len

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        sample = self.config.draft_sampling and not all(s.params.greedy for s in seqs)
        gens = self.generators(seqs) if sample else {}
        logits = torch.cat([self.carry[s.id][1] for s in seqs])
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        base = [s.total_len for s in seqs]  # the draft has seen positions 0..total_len-1
        for j in range(k):
            choice, q = _draft_choice(logits, seqs, sample, gens, lambda ids: ids)
            for b, c in enumerate(choice):
                drafts[b].append(c)
                if q[b] is not None:
                    qs[b].append(q[b])
            if j == k - 1:
                break
            meta = build_metadata(self.allocator, [(s.id, base[b] + j, base[b] + j + 1) for b, s in enumerate(seqs)],
                                  self.device)
            tokens = torch.tensor([d[-1] for d in drafts], device=self.device)
            with torch.inference_mode():
                h = self.forward_fn(tokens, meta, self.cache.layers, self.backend)
                logits = self.logits_fn(h)
        return Proposal(drafts, [torch.stack(q) if q else None for q in qs])

    def after_verify(self, seq: Sequence, n: int, accepted: int) -> None:
        """Drafts d_1..d_{k-1} were fed at positions n+1..n+k-1; the accepted ones stay valid."""
        self.cached[seq.id] = n + 1 + min(accepted, self.config.k - 1)


class MedusaProposer(_Proposer):
    """k Medusa heads read the target's last hidden state; no KV cache."""

    method = "medusa"

    def __init__(self, config: SpecConfig, head: Any, allocator: PageAllocator, device: torch.device) -> None:
        super().__init__(config, allocator, device, None)
        if config.k > head.config.medusa_num_heads:
            raise ValueError(f"k={config.k} exceeds the Medusa head count {head.config.medusa_num_heads}")
        self.head = head

    def absorb(self, items: list[tuple[Sequence, int, int, list[int]]], hidden: torch.Tensor,
               aux: dict[int, torch.Tensor]) -> None:
        for seq, _, end, rows in items:
            self.cached[seq.id] = end
            self.carry[seq.id] = (hidden[rows[-1]].unsqueeze(0), torch.zeros(0))

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        feats = self.head.target_features(torch.cat([self.carry[s.id][0] for s in seqs]))
        with torch.inference_mode():
            _, logits = self.head.draft_step(None, feats)  # (B, heads, V)
        logits = logits[:, :k]
        to_target = getattr(self.head, "to_target_ids", None) if self.head.lm_head is not None else None
        if self.config.draft_sampling and not all(s.params.greedy for s in seqs):
            gens = self.generators(seqs)
            drafts, qs = [[] for _ in seqs], [[] for _ in seqs]
            for j in range(k):
                choice, q = _draft_choice(logits[:, j], seqs, True, gens, to_target or (lambda ids: ids))
                for b, c in enumerate(choice):
                    drafts[b].append(c)
                    qs[b].append(q[b])
            return Proposal(drafts, [torch.stack(q) for q in qs])
        ids = logits.argmax(-1)
        if to_target is not None:
            ids = to_target(ids)
        return Proposal(ids.tolist(), [None] * len(seqs))

    def after_verify(self, seq: Sequence, n: int, accepted: int) -> None:
        self.cached[seq.id] = n


@dataclass
class Tree:
    """A draft tree for one sequence. Node 0 is the root (the pending token t_n); nodes are in
    verification order (by depth). children[i] lists node i's children in the order they are tried."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    children: list[list[int]]

    def ancestors(self, i: int) -> list[int]:
        out = []
        while i > 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def mask(self, prefix: int) -> torch.Tensor:
        """(M+1, prefix+M+1) bool: node i sees the prefix, the root, its ancestors and itself."""
        m = len(self.tokens)
        mask = torch.zeros(m, prefix + m, dtype=torch.bool)
        mask[:, : prefix + 1] = True
        for i in range(1, m):
            for a in self.ancestors(i):
                mask[i, prefix + a] = True
        return mask


class TreeProposer(HeadChainProposer):
    """EAGLE-2 dynamic trees over a chain head: expand the top-k children of the best `tree_topk`
    nodes per depth (by cumulative draft log-prob), then keep the best `tree_tokens` nodes overall.
    Head rows for expanded nodes attend to the prefix and their ancestors (tree mask)."""

    method = "tree"

    def propose_trees(self, seqs: list[Sequence]) -> list[Tree]:
        cfg = self.config
        topk, depth_limit = cfg.tree_topk, cfg.k
        n = [s.num_cached for s in seqs]
        # Per sequence: candidate nodes (token, parent, depth, score); node 0 is the root.
        tok = [[s.token_ids[-1]] for s in seqs]
        par = [[-1] for _ in seqs]
        dep = [[0] for _ in seqs]
        score = [[0.0] for _ in seqs]
        head_row: list[dict[int, int]] = [{} for _ in seqs]  # node -> head KV index (expanded nodes)
        frontier = [[(0, self.carry[s.id][0][0], self.carry[s.id][1][0])] for s in seqs]
        for d in range(1, depth_limit + 1):
            chosen: list[list[int]] = []
            for b in range(len(seqs)):
                new = []
                for node, _, logits in frontier[b]:
                    lp = torch.log_softmax(logits.float(), -1)
                    vals, ids = lp.topk(min(topk, lp.numel()))
                    tids = self.to_target(ids).tolist()
                    for v, t in zip(vals.tolist(), tids):
                        tok[b].append(t)
                        par[b].append(node)
                        dep[b].append(d)
                        score[b].append(score[b][node] + v)
                        new.append(len(tok[b]) - 1)
                new.sort(key=lambda i: -score[b][i])
                chosen.append(new[:topk])
            if d == depth_limit:
                break
            # Run the head on the chosen nodes: row (parent's output, token) at RoPE position n + d - 1.
            items, masks, positions, feats, tokens = [], [], [], [], []
            for b, s in enumerate(seqs):
                base = n[b] + len(head_row[b])
                rows = chosen[b]
                for j, node in enumerate(rows):
                    head_row[b][node] = base + j
                kv_len = base + len(rows)
                mask = torch.zeros(len(rows), kv_len, dtype=torch.bool)
                mask[:, : n[b]] = True
                for j, node in enumerate(rows):
                    a = node
                    while a > 0:
                        mask[j, head_row[b][a]] = True
                        a = par[b][a]
                items.append((s.id, base, kv_len))
                masks.append(mask)
                positions.append([n[b] + d - 1] * len(rows))
                parent_feat = {nd: f for nd, f, _ in frontier[b]}
                feats.extend(parent_feat[par[b][node]] for node in rows)
                tokens.extend(tok[b][node] for node in rows)
            meta = build_metadata(self.allocator, items, self.device, custom_masks=masks,
                                  positions_override=positions)
            with torch.inference_mode():
                self._plan(meta)
                h = self.head.forward_hidden(torch.tensor(tokens, device=self.device), torch.stack(feats), meta,
                                             self.cache.layers, self.backend)
                logits = self.head.compute_logits(h)
            row = 0
            for b in range(len(seqs)):
                frontier[b] = [(node, h[row + j], logits[row + j]) for j, node in enumerate(chosen[b])]
                row += len(chosen[b])
        return [self._rerank(tok[b], par[b], dep[b], score[b]) for b in range(len(seqs))]

    def _rerank(self, tok: list[int], par: list[int], dep: list[int], score: list[float]) -> Tree:
        budget = self.config.tree_tokens
        best = sorted(range(1, len(tok)), key=lambda i: -score[i])[:budget]
        keep = set(best)
        for i in best:  # ancestors score at least as high, but ties could drop one: keep them all
            a = par[i]
            while a > 0:
                keep.add(a)
                a = par[a]
        order = [0] + sorted(keep, key=lambda i: (dep[i], -score[i]))
        new_id = {old: j for j, old in enumerate(order)}
        children: list[list[int]] = [[] for _ in order]
        for old in order[1:]:
            children[new_id[par[old]]].append(new_id[old])
        for c in children:
            c.sort(key=lambda j: -score[order[j]])
        return Tree([tok[i] for i in order], [new_id[par[i]] if i else -1 for i in order], [dep[i] for i in order],
                    children)


def _draft_model_fns(draft: Any) -> tuple[Any, Any, KVCacheSpec]:
    """(forward(tokens, meta, caches, backend) -> h, logits(h) -> (N, V), KV spec) for a draft LM."""
    from headstart.heads.draft_lm import DraftLM
    from headstart.models.llama import LlamaForCausalLM

    if isinstance(draft, DraftLM):
        cfg = draft.config
        spec = KVCacheSpec(num_layers=cfg.num_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                           dtype=draft.norm.weight.dtype)

        def fwd(tokens, meta, caches, backend):  # noqa: ANN001, ANN202
            backend.plan(meta, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, draft.norm.weight.dtype)
            return draft.forward_hidden(tokens, None, meta, caches, backend)

        return fwd, draft.compute_logits, spec
    if isinstance(draft, LlamaForCausalLM):
        c = draft.config
        spec = KVCacheSpec(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                           dtype=draft.dtype)
        return (lambda tokens, meta, caches, backend: draft(tokens, meta, caches, backend)[0]), \
            draft.compute_logits, spec
    raise TypeError(f"a draft model must be a DraftLM head or a LlamaForCausalLM, got {type(draft).__name__}")

