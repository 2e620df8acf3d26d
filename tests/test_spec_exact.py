"""Speculation paths that must be exact, not merely lossless: a perfect draft model gives tau = k + 1
(also under chunked prefill, within the scheduler's budget and pages), and the drafts of chain heads and
the scores of EAGLE-2 tree nodes equal the training unroll over the same tokens."""

import random

import pytest
import torch
from test_spec import _prompts, _spec
from tiny_models import make_hf_model

from headstart.heads import HeadConfig, build_head
from headstart.inference import Engine, SamplingParams
from headstart.inference.speculation import SpecConfig
from headstart.models.llama import load_llama


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-target")
    make_hf_model("llama", d, seed=4)
    return load_llama(d, "fp32")


def test_a_perfect_draft_model_gives_tau_k_plus_one_exactly(target):
    """A draft_lm with all the target's layers (shared embedding and lm_head) is the target: every
    draft is accepted. A draft that forgets a KV row or mis-positions one falls below k + 1."""
    draft = build_head(HeadConfig(head_type="draft_lm", num_layers=target.num_layers), target)
    prompts = _prompts(4, seed=8)
    for k in (2, 3):
        params = SamplingParams(max_tokens=1 + (k + 1) * 6, ignore_eos=True)  # whole steps of k + 1
        ref = [o.token_ids for o in Engine(target, page_size=4).generate(prompts, params)]
        eng = Engine(target, page_size=4, spec=SpecConfig(method="draft", k=k, draft=draft))
        assert [o.token_ids for o in eng.generate(prompts, params)] == ref
        s = eng.spec_metrics.summary()
        assert s["tau"] == k + 1 and s["accept_histogram"][k] == s["steps"] == 4 * 6


def test_the_draft_model_follows_the_scheduler(target):
    """Long prompts under a small token budget and a tight page pool: every draft forward stays within
    the budget (the draft runs the target's chunks, not the rest of a prompt at once), the draft takes
    no page of its own, and speculation stays on: a perfect draft still gives tau = k + 1 exactly."""
    draft = build_head(HeadConfig(head_type="draft_lm", num_layers=target.num_layers), target)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (45, 30, 38)]
    k, budget = 3, 8
    params = SamplingParams(max_tokens=1 + (k + 1) * 5, ignore_eos=True)
    ref = [o.token_ids for o in Engine(target, page_size=4).generate(prompts, params)]
    # 3 x (45 + 21 + k + 1) slots at most: 18 + 13 + 16 pages; 48 leave no room for a draft's own pages.
    eng = Engine(target, page_size=4, num_pages=48, max_batched_tokens=budget,
                 spec=SpecConfig(method="draft", k=k, draft=draft))
    sizes = []
    forward = eng.proposer.runner.forward

    def recording(tokens, meta, *args, **kw):
        sizes.append(len(tokens))
        return forward(tokens, meta, *args, **kw)

    eng.proposer.runner.forward = recording
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert max(sizes) <= budget and sum(sizes) >= sum(map(len, prompts))
    s = eng.spec_metrics.summary()
    assert s["tau"] == k + 1 and s["steps"] >= 12  # at most 3 x 5; a few tokens come while others prefill
    assert eng.allocator.num_free == eng.allocator.num_pages and eng.stats.preemptions == 0


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_engine_drafts_equal_the_unrolled_training_forward(target, kind):
    """Each draft the engine proposes is the argmax of the training unroll over the same tokens:
    step j of the unroll at row n-1+j, where t_n is the pending token (positions, KV rows and fed-back
    features must all match)."""
    k = 3
    spec = _spec(target, kind, k=k)
    head = spec.head
    eng = Engine(target, page_size=4, spec=spec)
    seen = []
    propose = eng.proposer.propose

    def recording(seqs, kk):
        prop = propose(seqs, kk)
        seen.extend((list(s.token_ids), d) for s, d in zip(seqs, prop.drafts))
        return prop

    eng.proposer.propose = recording
    eng.generate(_prompts(3, seed=9), SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(seen) >= 6
    for tokens, drafts in seen:
        expect = [int(x.argmax()) for x in _unrolled_logits(head, target, tokens, drafts[:-1], k)]
        to_target = getattr(head, "to_target_ids", None)
        if to_target is not None:
            expect = to_target(torch.tensor(expect)).tolist()
        assert drafts == expect


def _unrolled_logits(head, target, tokens, drafts, k):
    """Per unroll step j, the head's logits at row n-1+j over tokens (t_n last) + drafts."""
    from headstart.heads import PackedBatch
    from headstart.train.module import target_forward
    from headstart.train.ttt import unroll

    n, seq = len(tokens) - 1, tokens + drafts
    aux = list(head.config.aux_layer_ids or [])
    b = target_forward(target, PackedBatch(torch.tensor(seq), [len(seq)], None, None, None), aux)
    with torch.no_grad():
        outs, _, _ = unroll(head, b, k)
    return [head.compute_logits(outs[j][n - 1 + j]).detach() for j in range(k)]


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_tree_node_scores_equal_the_unrolled_training_forward(target, kind):
    """Every candidate node of an EAGLE-2 tree carries the head's log-probability along its path, as
    the training unroll computes it over the path's tokens (tree masks, RoPE positions and the
    parents' features must all match a chain)."""
    k = 3
    head = _spec(target, kind).head
    eng = Engine(target, page_size=4, spec=SpecConfig(method="tree", k=k, head=head, tree_topk=2, tree_tokens=5))
    seen = []
    propose, rerank = eng.proposer.propose_trees, eng.proposer._rerank
    trees = []

    def recording_propose(seqs):
        seen.append([list(s.token_ids) for s in seqs])
        return propose(seqs)

    def capture(tok, par, dep, score):
        trees.append((tok, par, dep, score))
        return rerank(tok, par, dep, score)

    eng.proposer.propose_trees = recording_propose
    eng.proposer._rerank = capture
    eng.generate(_prompts(2, seed=10), SamplingParams(max_tokens=8, ignore_eos=True))
    prefixes = [t for step in seen for t in step]
    assert len(prefixes) == len(trees) >= 4
    checked = 0
    for tokens, (tok, par, dep, score) in zip(prefixes, trees):
        assert tok[0] == tokens[-1]
        for i in range(1, len(tok)):
            path, a = [], par[i]
            while a > 0:
                path.append(tok[a])
                a = par[a]
            logits = _unrolled_logits(head, target, tokens, path[::-1], dep[i])[dep[i] - 1]
            lp = torch.log_softmax(logits.float(), -1)
            to_target = getattr(head, "to_target_ids", None)
            draft_id = tok[i] if to_target is None else int(torch.nonzero(to_target(torch.arange(lp.numel()))
                                                                         == tok[i]))
            assert score[i] - score[par[i]] == pytest.approx(float(lp[draft_id]), abs=1e-4)
            checked += 1
    assert checked >= 4 * 2 * (1 + 2 + 2)  # 2 roots' children, then 2 x 2 per deeper level
    for tok, par, dep, score in trees:  # the nodes expanded at each depth: the best 2 by cumulative score
        for d in range(1, k):
            level = [i for i in range(len(tok)) if dep[i] == d]
            expanded = {par[i] for i in range(len(tok)) if dep[i] == d + 1}
            assert expanded == set(sorted(level, key=lambda i: -score[i])[:2])
