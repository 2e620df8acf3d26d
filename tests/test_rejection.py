"""The acceptance rules are lossless: the emitted token's distribution equals the target's p, for
every rule; the biased 'mixed' rule is caught by the same check. Plus the metrics definitions."""

import pytest
import torch

from headstart.inference.rejection import (
    verify_chain,
    verify_full_q,
    verify_greedy,
    verify_mixed_biased,
    verify_one_hot,
    verify_tree,
)
from headstart.inference.speculation import SpecMetrics

P = torch.tensor([[0.05, 0.40, 0.25, 0.20, 0.10], [0.3, 0.1, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.50, 0.10, 0.10, 0.20, 0.10], [0.2, 0.2, 0.2, 0.2, 0.2]])
N = 40000
# 4.5 standard deviations of a proportion near 0.5 at N=40000 is 0.011.
TOL = 0.011


def _first_token_freq(run):
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(5)
    for _ in range(N):
        counts[run(g)] += 1
    return counts / N


def _sample_q(g, q):
    return int(torch.multinomial(q, 1, generator=g))


def test_greedy_rule():
    p = torch.zeros(4, 5)
    p[0, 1] = p[1, 3] = p[2, 0] = p[3, 4] = 1.0
    assert verify_greedy([1, 3, 0], p).tokens == [1, 3, 0, 4]  # all accepted + bonus
    v = verify_greedy([1, 2, 0], p)
    assert v.accepted == 1 and v.tokens == [1, 3]  # stop at the first mismatch; bonus = argmax there


def test_one_hot_rule_is_lossless():
    draft = int(Q[0].argmax())  # chosen independently of the verifier's draws
    freq = _first_token_freq(lambda g: verify_one_hot([draft, 2], P, g).tokens[0])
    torch.testing.assert_close(freq, P[0], atol=TOL, rtol=0)


def test_full_q_rule_is_lossless():
    def run(g):
        drafts = [_sample_q(g, Q[0]), _sample_q(g, Q[1])]
        return verify_full_q(drafts, Q, P, g).tokens[0]

    torch.testing.assert_close(_first_token_freq(run), P[0], atol=TOL, rtol=0)


def test_the_biased_mixed_rule_is_detected():
    def run(g):
        drafts = [_sample_q(g, Q[0]), _sample_q(g, Q[1])]
        return verify_mixed_biased(drafts, Q, P, g).tokens[0]

    freq = _first_token_freq(run)
    assert (freq - P[0]).abs().max() > 5 * TOL  # far outside the tolerance the correct rules meet


def test_tree_rule_is_lossless():
    # Root with three candidate children (tokens 1, 3, 0); child 1 has its own child.
    children = [[1, 2, 3], [4], [], [], []]
    tokens = [9, 1, 3, 0, 2]
    p = torch.zeros(5, 5)
    p[0] = P[0]
    p[1:] = P[1]
    freq = _first_token_freq(lambda g: verify_tree(children, tokens, p, False, g)[1][0])
    torch.testing.assert_close(freq, P[0], atol=TOL, rtol=0)
    path, emitted = verify_tree(children, tokens, torch.nn.functional.one_hot(torch.tensor([3, 2, 0, 0, 4]), 5).float(),
                                True, None)
    assert path == [2] and emitted == [3, 0]  # greedy: child with argmax, then its bonus


def test_iid_acceptance_gives_the_closed_form_tau():
    k, alpha = 4, 0.6
    p = torch.zeros(k + 1, 5)
    p[:, 0], p[:, 1] = alpha, 1 - alpha  # the draft (token 0) has probability alpha everywhere
    g = torch.Generator().manual_seed(7)
    m = SpecMetrics()
    for _ in range(20000):
        m.add(verify_one_hot([0] * k, p, g).accepted, k)
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert m.summary()["tau"] == pytest.approx(expected, abs=0.03)


def test_metric_definitions():
    m = SpecMetrics()
    for a in (0, 1, 3, 3, 2):
        m.add(a, 3)
    s = m.summary()
    assert s["tau"] == pytest.approx(1 + 9 / 5) and s["alpha"] == pytest.approx(9 / 15)
    assert s["accept_rate_per_pos"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert s["cond_accept_per_pos"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert s["accept_histogram"] == [1, 1, 1, 2]


# ------------------------------------------------------------------ joint law at every position
# The emitted tokens of one verify step must follow the target's own sequential law: y_i ~ p_i; if
# y_i equals the draft x_i (a child's token, for trees) go on to position i+1, else stop; after the
# last draft the bonus y_k ~ p_k. Every row of p differs, so reading the wrong row at any position
# (bonus from row k-1, row 0 everywhere, the root's p deeper in a tree) changes this law.

K = 3
PJ = torch.tensor([[0.05, 0.40, 0.25, 0.20, 0.10],
                   [0.30, 0.10, 0.35, 0.05, 0.20],
                   [0.15, 0.15, 0.10, 0.45, 0.15],
                   [0.50, 0.05, 0.05, 0.10, 0.30]], dtype=torch.float64)
QJ = torch.tensor([[0.10, 0.50, 0.10, 0.20, 0.10],
                   [0.20, 0.10, 0.50, 0.10, 0.10],
                   [0.25, 0.25, 0.20, 0.20, 0.10]], dtype=torch.float64)
NJ = 30000


def _chain_law(drafts):
    """Exact law of the emitted sequence for fixed drafts."""
    law, prefix = {}, 1.0
    for i in range(K + 1):
        for y in range(5):
            if i < K and y == drafts[i]:
                continue
            law[tuple(drafts[:i]) + (y,)] = law.get(tuple(drafts[:i]) + (y,), 0.0) + prefix * float(PJ[i, y])
        if i < K:
            prefix *= float(PJ[i, drafts[i]])
    return law


def _full_q_law():
    """Drafts x_i ~ q_i: a run (y_0..y_m) has probability prod_{i<m} min(p_i, q_i)(y_i) times
    max(0, p_m - q_m)(y_m) for a rejection at m < k, or p_k(y_k) for the bonus. Summed over the
    accepted/rejected ways to emit y_0, position 0 is p_0 exactly (the lossless property)."""
    import itertools

    law = {}
    for m in range(K + 1):
        for seq in itertools.product(range(5), repeat=m + 1):
            pr = 1.0
            for i in range(m):
                pr *= float(torch.minimum(PJ[i], QJ[i])[seq[i]])
            pr *= float(PJ[K, seq[m]]) if m == K else float((PJ[m] - QJ[m]).clamp(min=0)[seq[m]])
            if pr > 0:
                law[seq] = pr
    return law


def _max_gap(run, law):
    g = torch.Generator().manual_seed(99)
    counts = {}
    for _ in range(NJ):
        seq = tuple(run(g))
        counts[seq] = counts.get(seq, 0) + 1
    if not set(counts) <= set(law):
        return float("inf")  # an output the law gives probability 0
    # Largest deviation in units of each outcome's own standard deviation.
    return max(abs(counts.get(s, 0) / NJ - pr) / max((pr * (1 - pr) / NJ) ** 0.5, 1e-9) for s, pr in law.items())


def test_one_hot_joint_law_at_every_position():
    drafts = [1, 2, 3]
    assert _max_gap(lambda g: verify_one_hot(drafts, PJ.float(), g).tokens, _chain_law(drafts)) < 5


def test_full_q_joint_law_at_every_position():
    law = _full_q_law()
    first = {}
    for seq, pr in law.items():
        first[seq[0]] = first.get(seq[0], 0.0) + pr
    assert [first[y] for y in range(5)] == pytest.approx(PJ[0].tolist())  # the law itself is lossless

    def run(g):
        xs = [_sample_q(g, QJ[i].float()) for i in range(K)]
        return verify_full_q(xs, QJ.float(), PJ.float(), g).tokens

    assert _max_gap(run, _full_q_law()) < 5


def test_a_bonus_from_the_wrong_row_is_caught():
    drafts = [1, 2, 3]

    def wrong_bonus(g):  # the one-hot rule, but the bonus drawn from row k-1
        v = verify_one_hot(drafts, PJ.float(), g)
        if v.accepted == K:
            return drafts + [int(torch.multinomial(PJ[K - 1].float(), 1, generator=g))]
        return v.tokens

    assert _max_gap(wrong_bonus, _chain_law(drafts)) > 8


def test_row_zero_everywhere_is_caught():
    def run(g):
        xs = [_sample_q(g, QJ[i].float()) for i in range(K)]
        p0 = PJ[0].float().expand(K + 1, 5)
        q0 = QJ[0].float().expand(K, 5)
        return verify_full_q(xs, q0, p0, g).tokens

    assert _max_gap(run, _full_q_law()) > 8


def _tree_law(children, tokens, p):
    law = {}

    def walk(node, prefix, pr):
        kids = {tokens[c]: c for c in children[node]}
        for y in range(5):
            py = pr * float(p[node, y])
            if y in kids:
                walk(kids[y], prefix + (y,), py)
            else:
                law[prefix + (y,)] = law.get(prefix + (y,), 0.0) + py
    walk(0, (), 1.0)
    return law


def test_tree_joint_law_at_every_depth():
    # root -> {1, 3}; node(1) -> {2, 0}; node(2) -> {3}: depth 3, siblings at two levels
    children = [[1, 2], [3, 4], [], [5], [], []]
    tokens = [9, 1, 3, 2, 0, 3]
    p = torch.stack([PJ[0], PJ[1], PJ[3], PJ[2], PJ[3], PJ[3]])  # every node its own p
    law = _tree_law(children, tokens, p)
    assert _max_gap(lambda g: verify_tree(children, tokens, p.float(), False, g)[1], law) < 5
    root_everywhere = p[0].expand(6, 5).float()
    assert _max_gap(lambda g: verify_tree(children, tokens, root_everywhere, False, g)[1], law) > 8


def test_an_empty_or_nan_distribution_is_a_clear_error():
    from headstart.inference.rejection import _sample

    for bad in (torch.zeros(5), torch.full((5,), float("nan"))):
        with pytest.raises(ValueError, match="no positive finite probability"):
            _sample(bad, None)
        with pytest.raises(ValueError, match="no positive finite probability"):
            verify_one_hot([1], torch.stack([bad, bad]), torch.Generator().manual_seed(0))


def test_merged_metrics_equal_the_steps_added_directly():
    import random

    rng = random.Random(3)
    steps = [(rng.randrange(5), 4) for _ in range(50)]
    a, b, whole = SpecMetrics(), SpecMetrics(), SpecMetrics()
    for i, (acc, d) in enumerate(steps):
        (a if i % 3 else b).add(acc, d)
        whole.add(acc, d)
    a.merge(b)
    assert a.summary() == whole.summary()


# -------------------------------------------- the batched rules (the engine's sampled verify path)


def _gap(outcomes, law):
    counts: dict = {}
    for seq in outcomes:
        counts[seq] = counts.get(seq, 0) + 1
    if not set(counts) <= set(law):
        return float("inf")
    n = len(outcomes)
    return max(abs(counts.get(s, 0) / n - pr) / max((pr * (1 - pr) / n) ** 0.5, 1e-9) for s, pr in law.items())


def _batched(drafts, q, g, greedy=None, p=None):
    n = drafts.shape[0]
    u = torch.rand(n, K + 1, generator=g, dtype=torch.float64)
    p = PJ.float().expand(n, K + 1, 5) if p is None else p
    greedy = torch.zeros(n, dtype=torch.bool) if greedy is None else greedy
    a, tokens, ok = verify_chain(drafts, p, q, u, greedy)
    assert bool(ok.all())
    return [tuple(t[:ai + 1]) for ai, t in zip(a.tolist(), tokens.tolist())]


def test_batched_one_hot_rule_follows_the_joint_law():
    """30,000 sequences in one call: the emitted runs follow the target's sequential law."""
    g = torch.Generator().manual_seed(5)
    drafts = torch.tensor([[1, 2, 3]]).expand(NJ, K)
    assert _gap(_batched(drafts, None, g), _chain_law([1, 2, 3])) < 5


def test_batched_full_q_rule_follows_the_joint_law():
    g = torch.Generator().manual_seed(6)
    drafts = torch.stack([torch.multinomial(QJ[i].float(), NJ, replacement=True, generator=g) for i in range(K)], 1)
    assert _gap(_batched(drafts, QJ.float().expand(NJ, K, 5), g), _full_q_law()) < 5


def test_batched_rules_catch_the_wrong_row():
    """The batched rule reading row 0 everywhere (or the bonus from row k-1) breaks the law."""
    g = torch.Generator().manual_seed(7)
    drafts = torch.tensor([[1, 2, 3]]).expand(NJ, K)
    row0 = PJ[0].float().expand(NJ, K + 1, 5)
    assert _gap(_batched(drafts, None, g, p=row0), _chain_law([1, 2, 3])) > 8
    shifted = torch.cat([PJ[:K], PJ[K - 1:K]]).float().expand(NJ, K + 1, 5)  # bonus from row k-1
    assert _gap(_batched(drafts, None, g, p=shifted), _chain_law([1, 2, 3])) > 8


def test_batched_greedy_rows_and_empty_distributions():
    p = PJ.float().expand(3, K + 1, 5).clone()
    best = p[0].argmax(-1).tolist()  # [1, 2, 3, 0]
    drafts = torch.tensor([best[:3], [best[0], 4, 4], [4, 4, 4]])
    u = torch.rand(3, K + 1, dtype=torch.float64)
    a, tokens, ok = verify_chain(drafts, p, None, u, torch.ones(3, dtype=torch.bool))
    assert a.tolist() == [3, 1, 0] and bool(ok.all())
    assert [t[:n + 1] for n, t in zip(a.tolist(), tokens.tolist())] == [best, best[:2], best[:1]]
    assert [verify_greedy(d, p[0]).tokens for d in drafts.tolist()] == [best, best[:2], best[:1]]
    p[1] = 0.0  # a request whose processed distribution has no mass: flagged, not sampled
    _, _, ok = verify_chain(drafts, p, None, torch.full((3, K + 1), 0.5, dtype=torch.float64),
                            torch.zeros(3, dtype=torch.bool))
    assert ok.tolist() == [True, False, True]
