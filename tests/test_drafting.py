"""Cheaper and smarter drafting, all lossless: adaptive draft length (a chain stops when the draft is
unsure) and prompt lookup (n-gram drafts, the no-training baseline)."""

import pytest
from test_spec import _prompts, _spec
from tiny_models import make_hf_model

from headstart.heads import HeadConfig, build_head
from headstart.inference import Engine, SamplingParams
from headstart.inference.ngram import lookup
from headstart.inference.speculation import SpecConfig
from headstart.models.llama import load_llama


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafting-target")
    make_hf_model("llama", d, seed=4)
    return load_llama(d, "fp32")


def test_lookup_takes_the_latest_longest_match():
    a, b, c, d, e = 1, 2, 3, 4, 5
    assert lookup([a, b, c, d, a, b], 3, 1, 4) == [c, d, a]  # the docstring's worked example
    assert lookup([a, b, c, e, b, d, a, b], 2, 1, 4) == [c, e]  # (a, b) beats the later 1-gram b -> d
    assert lookup([a, b, c, a, b, d, a, b], 2, 2, 4) == [d, a]  # the latest occurrence wins
    assert lookup([a, b, c, d], 3, 1, 4) == []  # d never occurred before
    assert lookup([a, b, a, b, a], 5, 2, 2) == [b, a]  # continuations stop at the end of the tokens
    assert lookup([a], 3, 1, 4) == []


def test_ngram_speculation_is_lossless_and_drafts_on_repeats(target):
    rng_prompts = _prompts(3, seed=31)
    loop = [7, 8, 9, 10, 11] * 6  # a prompt that repeats itself: lookup finds drafts from step one
    prompts = rng_prompts + [loop]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in Engine(target, page_size=4).generate(prompts, greedy)]
    for batch in (1, 4):
        eng = Engine(target, page_size=4, max_batch_size=batch, spec=SpecConfig(method="ngram", k=3))
        assert [o.token_ids for o in eng.generate(prompts, greedy)] == ref
        s = eng.spec_metrics.summary()
        assert s["steps"] > 0 and 1 <= s["tau"] <= 4
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(4)]
    a = Engine(target, page_size=4, spec=SpecConfig(method="ngram", k=3)).generate(prompts, sampled)
    b = Engine(target, page_size=4, spec=SpecConfig(method="ngram", k=3)).generate(prompts, sampled)
    assert [o.token_ids for o in a] == [o.token_ids for o in b] and all(len(o.token_ids) == 12 for o in a)


def test_adaptive_draft_length_with_a_perfect_draft(target):
    """A perfect draft model accepts everything: without a threshold (or one nothing falls below) a
    step emits k + 1 tokens; with a threshold above every confidence each step drafts one token and
    emits exactly two. Either way the output is the target's, so the draft's cache followed the
    shortened steps (a cache that assumed k drafts would drift and lose acceptance)."""
    draft = build_head(HeadConfig(head_type="draft_lm", num_layers=target.num_layers), target)
    prompts = _prompts(4, seed=8)
    k = 3
    params = SamplingParams(max_tokens=1 + 2 * 6, ignore_eos=True)
    ref = [o.token_ids for o in Engine(target, page_size=4).generate(prompts, params)]
    for threshold, tau in ((None, None), (1e-9, None), (0.999, 2.0)):
        eng = Engine(target, page_size=4, spec=SpecConfig(method="draft", k=k, draft=draft,
                                                          draft_threshold=threshold))
        assert [o.token_ids for o in eng.generate(prompts, params)] == ref
        s = eng.spec_metrics.summary()
        if tau is None:
            assert s["accept_histogram"][k] == s["steps"] - 4 or s["tau"] > 3  # whole steps of k + 1, ends cut
        else:
            assert s["tau"] == tau and eng.spec_metrics.drafted_total == s["steps"]


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_adaptive_chains_are_lossless_and_draft_less(target, kind):
    prompts = _prompts(4, seed=9)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in Engine(target, page_size=4).generate(prompts, greedy)]
    spec = _spec(target, kind, k=4)
    full = Engine(target, page_size=4, spec=spec)
    assert [o.token_ids for o in full.generate(prompts, greedy)] == ref
    spec.draft_threshold = 0.5
    short = Engine(target, page_size=4, spec=spec)
    assert [o.token_ids for o in short.generate(prompts, greedy)] == ref
    per_step = short.spec_metrics.drafted_total / short.spec_metrics.steps
    assert per_step < full.spec_metrics.drafted_total / full.spec_metrics.steps == 4


def test_bad_drafting_settings_are_refused():
    with pytest.raises(ValueError, match="draft_threshold"):
        SpecConfig(method="tree", k=3, draft_threshold=0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        SpecConfig(method="chain", k=3, draft_threshold=1.5)
    with pytest.raises(ValueError, match="ngram_min"):
        SpecConfig(method="ngram", k=3, ngram_min=3, ngram_max=2)
