import pytest
import torch

from headstart.inference.sampler import SamplingParams, draw, processed_probs, sample, token_logprobs


def _p(logits, **kw):
    return processed_probs(torch.tensor([logits]), [SamplingParams(**kw)])[0]


def test_greedy_is_one_hot_at_argmax():
    p = _p([0.1, 2.0, -1.0, 1.9])
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    torch.testing.assert_close(_p(logits.tolist(), temperature=1.0), torch.tensor([0.5, 0.25, 0.15, 0.1]))
    t2 = torch.softmax(logits / 2.0, -1)
    torch.testing.assert_close(_p(logits.tolist(), temperature=2.0), t2)
    torch.testing.assert_close(_p(logits.tolist(), temperature=1.0, top_k=2), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    # top_p=0.7: 0.5 alone is < 0.7, so 0.25 joins; 0.15 is not needed.
    torch.testing.assert_close(_p(logits.tolist(), temperature=1.0, top_p=0.7), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    torch.testing.assert_close(_p(logits.tolist(), temperature=1.0, top_p=0.75),
                               torch.tensor([2 / 3, 1 / 3, 0, 0]))
    torch.testing.assert_close(_p(logits.tolist(), temperature=1.0, top_p=0.76),
                               torch.tensor([0.5, 0.25, 0.15, 0]) / 0.9)
    # min_p=0.4: keep p >= 0.2
    torch.testing.assert_close(_p(logits.tolist(), temperature=1.0, min_p=0.4), torch.tensor([2 / 3, 1 / 3, 0, 0]))


def test_mixed_batch_rows_are_independent():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [0.0, 0.0, 5.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.5)]
    p = processed_probs(logits, params)
    assert p[0].tolist() == [0, 0, 1] and p[1].tolist() == [1, 0, 0]
    torch.testing.assert_close(p[2], torch.softmax(logits[2] / 0.5, -1))


def test_repetition_penalty_matches_hf():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    hist = [0, 1, 1]
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([hist]), logits.clone())
    got = processed_probs(logits, [SamplingParams(temperature=1.0, repetition_penalty=1.3)], [hist])
    torch.testing.assert_close(got[0], torch.softmax(ref[0], -1))


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0)] * 3

    def gens():
        return [torch.Generator().manual_seed(s) for s in (11, 12, 13)]

    together = [sample(logits, params, g).tolist() for g in [gens()]][0]
    g = gens()
    alone = [sample(logits[i:i + 1], params[:1], [g[i]]).item() for i in range(3)]
    assert together == alone


def test_empirical_distribution_matches_p():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        counts[draw(probs, [g])] += 1
    assert counts[1] == 0
    # 4 standard deviations of a binomial proportion at n=20000 is < 0.014.
    torch.testing.assert_close(counts / n, probs[0], atol=0.014, rtol=0)


def test_invalid_params():
    for kw, msg in [({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                    ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"min_p": 2}, "min_p"),
                    ({"repetition_penalty": 0}, "repetition_penalty")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)


def test_logprobs():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = token_logprobs(logits, torch.tensor([2]), top_n=2)[0]
    lp = torch.log_softmax(logits[0], -1)
    assert out["token_id"] == 2 and out["logprob"] == pytest.approx(lp[2].item())
    assert [i for i, _ in out["top"]] == [2, 1]
