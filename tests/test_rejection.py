"""The acceptance rules are lossless: the emitted token's distribution equals the target's p, for
every rule; the biased 'mixed' rule is caught by the same check. Plus the metrics definitions."""

import pytest
import torch

from headstart.inference.rejection import (
    verify_full_q,
    verify_greedy,
    verify_mixed_biased,
    verify_one_hot,
    verify_tree,
)
from headstart.inference.spec import SpecMetrics

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
