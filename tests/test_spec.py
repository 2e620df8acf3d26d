"""Speculative decoding in the engine: lossless greedy for every proposer (tiny fp32 targets, with
continuous batching and preemption), stub proposers with known acceptance, seeded sampling."""

import random

import pytest
import torch
from tiny_models import make_hf_model

from headstart.heads import HeadConfig, build_head
from headstart.inference import Engine, SamplingParams
from headstart.inference.proposers import Proposal, _Proposer
from headstart.inference.speculation import SpecConfig
from headstart.models.llama import load_llama

KINDS = ["mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm", "dflash"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-target")
    make_hf_model("llama", d, seed=4)
    return load_llama(d, "fp32")


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 320) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def _spec(target, kind, k=3, **kw):
    cfg = HeadConfig(head_type=kind, aux_layer_ids=[0, 1, 2] if kind in ("eagle3", "dflash") else None,
                     num_layers=2 if kind == "dflash" else 1, block_size=4 if kind == "dflash" else None)
    head = build_head(cfg, target)
    method = {"medusa": "medusa", "draft_lm": "draft", "dflash": "block"}.get(kind, "chain")
    if method == "draft":
        return SpecConfig(method=method, k=k, draft=head, **kw)
    return SpecConfig(method=method, k=k, head=head, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_is_lossless_for_every_proposer(target, kind):
    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (5, 20, 13, 1, 17, 9)]
    ref = [o.token_ids for o in Engine(target, page_size=4).generate(prompts, params)]
    eng = Engine(target, page_size=4, spec=_spec(target, kind))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert eng.allocator.num_free == eng.allocator.num_pages
    s = eng.spec_metrics.summary()
    # The engine's metrics are the requests' metrics pooled (same steps, same accepted drafts).
    per = [o.spec_metrics for o in outs if o.spec_metrics["steps"]]
    assert s["steps"] == sum(m["steps"] for m in per) > 0
    assert s["tau"] == pytest.approx(sum(m["tau"] * m["steps"] for m in per) / s["steps"])
    assert outs[1].spec_metrics["steps"] > 0


@pytest.mark.parametrize("kind", ["mtp", "draft_lm", "medusa", "dflash"])
def test_lossless_under_preemption_and_stop_tokens(target, kind):
    prompts = _prompts(12, seed=3)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[7, 11]) for _ in prompts]
    ref = [o.token_ids for o in Engine(target, page_size=2).generate(prompts, params)]
    eng = Engine(target, page_size=2, num_pages=40, max_batch_size=12, spec=_spec(target, kind, k=3))
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.stats.preemptions > 0
    assert eng.allocator.num_free == eng.allocator.num_pages


class OracleProposer(_Proposer):
    """Knows the target's greedy continuation; proposes the first `right` drafts correctly."""

    method = "oracle"

    def __init__(self, cfg, continuations, right):
        super().__init__(cfg, None)
        self.continuations, self.right = continuations, right

    def absorb(self, items, hidden, aux):
        for seq, _, end, _ in items:
            seq.draft.cached = end
            seq.draft.carry = (torch.zeros(0), torch.zeros(0))

    def propose(self, seqs, k):
        drafts = []
        for s in seqs:
            truth = self.continuations[s.id][len(s.output_ids):] + [0] * k
            drafts.append([t if j < self.right else (t + 1) % 320 for j, t in enumerate(truth[:k])])
        return Proposal(drafts, [None] * len(seqs))

    def after_verify(self, seq, n, accepted):
        seq.draft.cached = n


@pytest.mark.parametrize(("right", "tau"), [(3, 4.0), (0, 1.0), (1, 2.0), (2, 3.0)])
def test_stub_proposers_give_the_expected_tau(target, right, tau):
    prompts = _prompts(3, seed=5)
    params = SamplingParams(max_tokens=37, ignore_eos=True)  # 1 sampled + 36 = whole steps of 1, 2, 3 or 4
    ref = Engine(target, page_size=4).generate(prompts, params, request_ids=["a", "b", "c"])
    eng = Engine(target, page_size=4, spec=_spec(target, "medusa"))
    eng.proposer = OracleProposer(eng.spec, {o.id: o.token_ids for o in ref}, right)
    outs = eng.generate(prompts, params, request_ids=["a", "b", "c"])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    s = eng.spec_metrics.summary()
    # Every step accepts exactly `right` drafts and emits right + 1 tokens.
    assert s["tau"] == pytest.approx(tau)
    assert s["alpha"] == pytest.approx(right / 3)
    assert s["accept_histogram"][right] == s["steps"]


@pytest.mark.parametrize("draft_sampling", [False, True])
def test_sampling_with_speculation_is_seeded(target, draft_sampling):
    prompts = _prompts(3, seed=6)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=10 + i, ignore_eos=True)
              for i in range(3)]

    def run():
        eng = Engine(target, page_size=4, spec=_spec(target, "mtp", draft_sampling=draft_sampling))
        return [o.token_ids for o in eng.generate(prompts, params)], eng.spec_metrics.summary()

    a, sa = run()
    b, _ = run()
    assert a == b and all(len(t) == 12 for t in a)
    assert sa["steps"] > 0


def test_spec_config_errors(target):
    with pytest.raises(ValueError, match="unknown speculation method"):
        SpecConfig(method="lookahead")
    with pytest.raises(ValueError, match="k must be >= 1"):
        SpecConfig(method="chain", k=0)
    with pytest.raises(ValueError, match="needs a head"):
        Engine(target, spec=SpecConfig(method="chain"))
    medusa = build_head(HeadConfig(head_type="medusa", medusa_num_heads=2), target)
    with pytest.raises(ValueError, match="cannot use a 'medusa' head"):
        Engine(target, spec=SpecConfig(method="chain", head=medusa))
    with pytest.raises(ValueError, match="exceeds the Medusa head count"):
        Engine(target, spec=SpecConfig(method="medusa", head=medusa, k=3))


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
@pytest.mark.parametrize(("topk", "tokens", "depth"), [(2, 4, 3), (4, 16, 5), (1, 1, 1)])
def test_tree_greedy_is_lossless(target, kind, topk, tokens, depth):
    prompts = _prompts(5, seed=8)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (18, 3, 11, 20, 7)]
    ref = [o.token_ids for o in Engine(target, page_size=4).generate(prompts, params)]
    spec = _spec(target, kind)
    eng = Engine(target, page_size=4, spec=SpecConfig(method="tree", head=spec.head, k=depth, tree_topk=topk,
                                                      tree_tokens=tokens))
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.allocator.num_free == eng.allocator.num_pages
    s = eng.spec_metrics.summary()
    assert len(s["accept_rate_per_pos"]) == depth and s["steps"] > 0


def test_tree_sampling_is_seeded(target):
    prompts = _prompts(3, seed=9)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(3)]
    head = _spec(target, "mtp").head

    def run():
        eng = Engine(target, page_size=4, spec=SpecConfig(method="tree", head=head, k=3, tree_topk=3, tree_tokens=6))
        return [o.token_ids for o in eng.generate(prompts, params)]

    assert run() == run()


def test_tree_mask_and_rerank():
    from headstart.inference.tree import Tree

    # root -> 1 -> 3 ; root -> 2
    tree = Tree(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2], children=[[1, 2], [3], [], []])
    m = tree.mask(prefix=2)
    assert m.shape == (4, 6)
    assert m[3].tolist() == [True, True, True, True, False, True]  # prefix, root, node 1, itself
    assert m[2].tolist() == [True, True, True, False, True, False]
    assert tree.ancestors(3) == [1, 3]


def test_rerank_keeps_the_best_nodes_with_their_ancestors():
    from types import SimpleNamespace

    from headstart.inference.tree import TreeProposer

    # candidates: 0 root; 1, 2 at depth 1; 3, 4 under 1; 5 under 2 (scores: cumulative log-probs)
    tok = [9, 10, 11, 12, 13, 14]
    par = [-1, 0, 0, 1, 1, 2]
    dep = [0, 1, 1, 2, 2, 2]
    score = [0.0, -0.5, -0.2, -0.6, -2.0, -0.3]
    proposer = SimpleNamespace(config=SpecConfig(method="tree", k=2, tree_tokens=3))
    tree = TreeProposer._rerank(proposer, tok, par, dep, score)
    # the best 3 are 2 (-0.2), 5 (-0.3), 1 (-0.5); node 3 (-0.6) and 4 are dropped
    assert tree.tokens == [9, 11, 10, 14] and tree.parents == [-1, 0, 0, 1] and tree.depths == [0, 1, 1, 2]
    assert tree.children == [[1, 2], [3], [], []]  # siblings tried best first
    proposer.config.tree_tokens = 4  # now node 3 (-0.6) comes in, under node 1
    tree = TreeProposer._rerank(proposer, tok, par, dep, score)
    assert tree.tokens == [9, 11, 10, 14, 12] and tree.children == [[1, 2], [3], [4], [], []]


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_logprobs_survive_speculation(target, method):
    prompts = _prompts(2, seed=10)
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    ref = Engine(target, page_size=4).generate(prompts, params)
    spec = _spec(target, "mtp", k=3)
    if method == "tree":
        spec = SpecConfig(method="tree", k=3, head=spec.head, tree_topk=2, tree_tokens=6)
    outs = Engine(target, page_size=4, spec=spec).generate(prompts, params)
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids and len(o.logprobs) == len(o.token_ids) == 20
        for a, b in zip(o.logprobs, r.logprobs):
            assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]


@pytest.mark.parametrize("kind", ["mtp", "draft_lm", "medusa"])
def test_a_server_loop_keeps_no_per_request_state(target, kind):
    eng = Engine(target, page_size=4, spec=_spec(target, kind))
    prompts = _prompts(6, seed=12)
    ids = [eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    eng.step()
    eng.step()
    assert eng.abort(ids[0]) and eng.abort(ids[3])
    while eng.has_unfinished():
        eng.step()
    assert not eng._seqs
    # Per-request draft state lives on the sequences (seq.draft); the proposer keeps none of its own.
    assert not [k for k, v in vars(eng.proposer).items() if isinstance(v, dict | list | set) and v]
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_unseeded_requests_do_not_repeat(target):
    eng = Engine(target, page_size=4, spec=_spec(target, "mtp", draft_sampling=True))
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    prompt = _prompts(1, seed=13)
    a = eng.generate(prompt * 2, params)
    b = eng.generate(prompt, params)
    assert a[0].token_ids != a[1].token_ids and b[0].token_ids not in (a[0].token_ids, a[1].token_ids)
    same = Engine(target, page_size=4, spec=_spec(target, "mtp", draft_sampling=True)).generate(prompt * 2, params)
    assert [o.token_ids for o in same] == [o.token_ids for o in a]  # a seeded engine stays reproducible


@pytest.mark.parametrize("kind", ["medusa", "eagle3", "mtp", "eagle1", "deepseek_mtp"])
def test_reduced_draft_vocabularies_in_the_engine(target, kind):
    """Every head family with a draft vocabulary (Medusa / eagle3: their own lm_head; mtp, eagle1,
    deepseek_mtp: the target's rows): lossless greedy, drafts inside the vocabulary, and draft
    sampling verified with the full-q rule on q spread over the target vocabulary (seeded)."""
    from headstart.heads import build_vocab_maps

    head = build_head(HeadConfig(head_type=kind, draft_vocab_size=64,
                                 aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None), target)
    d2t, _ = build_vocab_maps(torch.arange(320, 0, -1).float() ** 0.5, 64)
    t2d = _t2d(d2t, 3)
    head.set_vocab_maps(d2t + 3 * (torch.arange(64) > 20), t2d)
    method = "medusa" if kind == "medusa" else "chain"
    prompts = _prompts(3, seed=14)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = [o.token_ids for o in Engine(target, page_size=4).generate(prompts, greedy)]
    eng = Engine(target, page_size=4, spec=SpecConfig(method=method, k=3, head=head))
    assert [o.token_ids for o in eng.generate(prompts, greedy)] == ref
    allowed = set(torch.nonzero(t2d).flatten().tolist())
    drafted = set(head.to_target_ids(torch.arange(64)).tolist())
    assert drafted == allowed and len(allowed) == 64
    if kind in ("mtp", "eagle1", "deepseek_mtp"):  # the target's lm_head rows, no parameter of its own
        plain = build_head(HeadConfig(head_type=kind), target)
        assert sum(p.numel() for p in head.parameters()) == sum(p.numel() for p in plain.parameters())
        feats = torch.randn(5, head.config.hidden_size)
        full = head.target.lm_head(feats).float()
        assert torch.equal(head.lm_logits(feats), full[:, sorted(allowed)])
    sampled = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)]
    outs = Engine(target, page_size=4, spec=SpecConfig(method=method, k=3, head=head, draft_sampling=True)
                  ).generate(prompts, sampled)
    assert all(len(o.token_ids) == 10 for o in outs)


def _t2d(d2t, shift):
    t2d = torch.zeros(320, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t + shift * (torch.arange(d2t.numel()) > 20)] = True
    return t2d


def _exact_first_tokens(target, prompt, params, n=3):
    """The target's own law of the first n sampled tokens (processed like the sampler does)."""
    from headstart.inference.sampler import processed_probs
    from headstart.nn.attention import PackedCausalAttention, packed_metadata

    def next_probs(prefixes):
        seqs = [prompt + list(p) for p in prefixes]
        ids = torch.tensor([t for s in seqs for t in s])
        meta = packed_metadata([len(s) for s in seqs])
        with torch.no_grad():
            h, _ = target(ids, meta, [None] * target.num_layers, PackedCausalAttention())
        last = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
        return processed_probs(target.compute_logits(h, last), [params] * len(seqs)).double()

    law = {(): 1.0}
    for _ in range(n):
        prefixes = list(law)
        probs = next_probs(prefixes)
        law = {pre + (t,): pr * float(probs[i, t]) for i, (pre, pr) in enumerate(law.items())
               for t in torch.nonzero(probs[i] > 0).flatten().tolist()}
    return law


@pytest.mark.parametrize("method", ["chain", "full_q", "full_q_draft_vocab", "full_q_shared_draft_vocab", "draft",
                                    "tree", "tree_draft_vocab", "ngram", "block_full_q_draft_vocab"])
def test_sampled_speculation_follows_the_target_law_at_every_position(target, method, request):
    """T = 0.8, top-k 3: the first three emitted tokens (one from prefill, two from a speculative
    step) follow the target's own sequential law, for every proposer and rule."""
    prompt = _prompts(1, seed=LAW_PROMPT_SEED)[0]
    n = 3000 if "draft_vocab" in method else 1200  # more samples: a lossy q spread shifts each cell a little
    params = [SamplingParams(max_tokens=3, temperature=0.8, top_k=3, seed=1000 + i, ignore_eos=True)
              for i in range(n)]
    if method == "tree":
        spec = SpecConfig(method="tree", k=2, head=_spec(target, "mtp").head, tree_topk=2, tree_tokens=4)
    elif method == "tree_draft_vocab":  # an EAGLE-2 tree over the target's lm_head rows of 64 tokens
        spec = SpecConfig(method="tree", k=2, head=request.getfixturevalue("fitted")["mtp"], tree_topk=2,
                          tree_tokens=4)
    elif method == "ngram":
        spec = SpecConfig(method="ngram", k=2, ngram_min=1)
    elif method == "full_q_shared_draft_vocab":
        spec = SpecConfig(method="chain", k=2, head=request.getfixturevalue("fitted")["mtp"], draft_sampling=True)
    elif method == "draft":
        spec = _spec(target, "draft_lm", k=2)
    elif method == "block_full_q_draft_vocab":  # a fitted DFlash block: q per slot, sampled drafts
        spec = SpecConfig(method="block", k=2, head=fitted_dflash(target), draft_sampling=True)
    elif method == "full_q_draft_vocab":  # q over 64 draft tokens, spread onto the target vocabulary
        spec = SpecConfig(method="chain", k=2, head=request.getfixturevalue("fitted")["eagle3"],
                          draft_sampling=True)
    else:
        spec = _spec(target, "mtp", k=2, draft_sampling=method == "full_q")
    eng = Engine(target, page_size=4, max_batch_size=64, spec=spec)
    outs = eng.generate([prompt] * n, params)
    s = eng.spec_metrics.summary()
    assert s["steps"] > 0
    if "draft_vocab" in method:  # a fitted head: drafts are accepted often, so the spread q matters
        assert (s["tau"] > 1.5 if method.startswith("tree") else s["alpha"] > 0.3), s  # a tree drafts 4 nodes
    law = _exact_first_tokens(target, prompt, params[0])
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert set(counts) <= set(law)
    z = max(abs(counts.get(s, 0) / n - p) / max((p * (1 - p) / n) ** 0.5, 1e-9) for s, p in law.items())
    assert z < 5, z


LAW_PROMPT_SEED = 21  # the prompt of the target-law tests


@pytest.fixture(scope="module")
def fitted(target):
    """eagle3, Medusa and mtp heads with a 64-token draft vocabulary, fitted for a few seconds (our own
    loss) to the target's greedy continuations of four prompts and of the target-law prompt."""
    from headstart.heads import PackedBatch, build_vocab_maps
    from headstart.recipe_io import recipe_from_dict
    from headstart.train.module import HeadModule

    prompts = _prompts(4, seed=0) + _prompts(1, seed=LAW_PROMPT_SEED)
    ref = Engine(target, page_size=4).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    seqs = [p + o.token_ids for p, o in zip(prompts, ref)]
    ids = torch.tensor([t for s in seqs for t in s])
    mask = torch.tensor([float(i >= len(p)) for p, s in zip(prompts, seqs) for i in range(len(s))])
    heads = {}
    for kind in ("eagle3", "medusa", "mtp"):
        torch.manual_seed(0)
        head = build_head(HeadConfig(head_type=kind, draft_vocab_size=64,
                                     aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None), target)
        counts = torch.bincount(ids[mask > 0], minlength=320).float()
        head.set_vocab_maps(*build_vocab_maps(counts, 64))
        module = HeadModule(recipe_from_dict({"train": {"ttt_steps": 3}}), target, head)
        batch = PackedBatch(ids, [len(s) for s in seqs], None, None, mask)
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
        for _ in range(150):
            loss, _ = module.losses(batch, with_stats=False)
            opt.zero_grad()
            loss.backward()
            opt.step()
        heads[kind] = head.requires_grad_(False)
    return heads


_FITTED_DFLASH = {}


def fitted_dflash(target):
    """A dflash head (block 4, two layers, a 64-token draft vocabulary) fitted for a few seconds with the
    block objective to the target's greedy continuations of four prompts and of the target-law prompt."""
    if id(target) in _FITTED_DFLASH:
        return _FITTED_DFLASH[id(target)]
    from headstart.heads import PackedBatch, build_vocab_maps
    from headstart.recipe_io import recipe_from_dict
    from headstart.train.module import HeadModule, target_forward

    prompts = _prompts(4, seed=0) + _prompts(1, seed=LAW_PROMPT_SEED)
    ref = Engine(target, page_size=4).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    seqs = [p + o.token_ids for p, o in zip(prompts, ref)]
    ids = torch.tensor([t for s in seqs for t in s])
    mask = torch.tensor([float(i >= len(p) - 1) for p, s in zip(prompts, seqs) for i in range(len(s))])
    torch.manual_seed(0)
    head = build_head(HeadConfig(head_type="dflash", draft_vocab_size=64, aux_layer_ids=[0, 1, 2], num_layers=2,
                                 block_size=4), target)
    head.set_vocab_maps(*build_vocab_maps(torch.bincount(ids[mask > 0], minlength=320).float(), 64))
    module = HeadModule(recipe_from_dict({"head": {"type": "dflash", "block_size": 4}}), target, head)
    batch = target_forward(target, PackedBatch(ids, [len(s) for s in seqs], None, None, mask), [0, 1, 2])
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for step in range(200):
        module.consumed = step  # new anchors each step
        loss, _ = module.losses(batch, with_stats=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _FITTED_DFLASH[id(target)] = head.requires_grad_(False)
    return head


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "mtp"])
def test_trained_heads_with_draft_vocabularies_accept_in_the_engine(target, fitted, kind):
    """The fitted heads accept most drafts in the engine, whole steps included, greedy and with
    sampled drafts verified by the full-q rule."""
    head = fitted[kind]
    prompts = _prompts(4, seed=0)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = Engine(target, page_size=4).generate(prompts, greedy)
    method = "medusa" if kind == "medusa" else "chain"
    eng = Engine(target, page_size=4, spec=SpecConfig(method=method, k=3, head=head))
    assert [o.token_ids for o in eng.generate(prompts, greedy)] == [o.token_ids for o in ref]
    s = eng.spec_metrics.summary()
    assert s["tau"] > 2.5 and s["accept_histogram"][3] > s["steps"] / 3, s
    sampled = [SamplingParams(max_tokens=24, temperature=0.5, seed=i, ignore_eos=True) for i in range(4)]
    eng = Engine(target, page_size=4, spec=SpecConfig(method=method, k=3, head=head, draft_sampling=True))
    eng.generate(prompts, sampled)
    s = eng.spec_metrics.summary()
    assert s["alpha"] > 0.05, s  # sampled drafts (T = 0.5) still pass the full-q rule


def test_greedy_speculation_with_a_repetition_penalty_is_lossless(target):
    prompts = _prompts(4, seed=12)
    params = SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.5)
    ref = [o.token_ids for o in Engine(target, page_size=4).generate(prompts, params)]
    eng = Engine(target, page_size=4, spec=_spec(target, "mtp"))
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.spec_metrics.summary()["steps"] > 0


@pytest.mark.parametrize("kind", ["mtp", "draft_lm", "medusa"])
def test_after_every_step_a_sequence_holds_exactly_its_cached_slots(target, kind):
    """Rejected drafts give their slots back at once: after each step, every running sequence has
    exactly num_cached slots reserved (a leak would only show when the pool runs dry)."""
    eng = Engine(target, page_size=4, spec=_spec(target, kind))
    for p in _prompts(4, seed=6):
        eng.add_request(p, SamplingParams(max_tokens=14, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
        for seq in eng.scheduler.running:
            assert eng.allocator.length(seq.id) == seq.num_cached
    assert eng.spec_metrics.steps > 0
