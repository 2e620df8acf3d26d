"""Acceptance measured the same whatever the batch: eval's batch groups and training's validation prefill
every prompt of a group in one step, so no prompt decodes plainly while the others still prefill."""

import random

import pytest
from tiny_models import make_hf_model

from headstart.evaluate import EvalPlan, _engine
from headstart.heads import HeadConfig, build_head
from headstart.inference import SamplingParams
from headstart.inference.scheduler import MEASURED_PREFILL_CAP, kv_pages_for, one_step_prefill_budget
from headstart.inference.speculation import SpecConfig
from headstart.models.llama import load_llama
from headstart.train.validate import engine_acceptance


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefill-target")
    make_hf_model("llama", d, seed=4)
    return load_llama(d, "fp32")


@pytest.fixture(scope="module")
def head(target):
    return build_head(HeadConfig(head_type="eagle3", aux_layer_ids=[0, 1, 2]), target)


def _long_prompts(n, seed=5):
    """n prompts of 300-420 tokens: six of them hold more than the engine's default 2,048-token budget."""
    rng = random.Random(seed)
    return [[rng.randrange(2, 320) for _ in range(rng.randint(300, 420))] for _ in range(n)]


def _summed(summaries, key):
    return [sum(col) for col in zip(*(s[key] for s in summaries))]


def test_validation_measures_a_batch_as_it_measures_each_prompt_alone(target, head):
    prompts = _long_prompts(6)
    assert sum(map(len, prompts)) > 2048
    together = engine_acceptance(target, head, prompts, k=3, max_tokens=12)
    alone = [engine_acceptance(target, head, [p], k=3, max_tokens=12) for p in prompts]
    assert together["steps"] == sum(a["steps"] for a in alone)
    assert together["accept_histogram"] == _summed(alone, "accept_histogram")


def test_validation_of_more_prompts_than_the_prefill_cap_measures_them_as_one_batch(target, head, monkeypatch):
    """Over the cap the prompts run a few at a time in one engine, each admitted while others decode (they wait
    for it): the same summary as all at once, with KV pages for the longest few at once."""
    from headstart.inference.engine import Engine

    prompts = _long_prompts(6, seed=7)
    one = engine_acceptance(target, head, prompts, k=3, max_tokens=12)
    built, real = [], Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **kw: built.append(kw) or real(self, *a, **kw))
    capped = engine_acceptance(target, head, prompts, k=3, max_tokens=12, prefill_cap=800)  # 2 prompts at a time
    pages = sorted((-(-(len(p) + 12 + 4 + 1) // 16) + 1 for p in prompts), reverse=True)  # lookahead k + 1
    assert [(kw["max_batch_size"], kw["num_pages"]) for kw in built] == [(2, pages[0] + pages[1] + 8)]
    keys = ("steps", "accept_histogram", "tau", "accept_rate_per_pos", "prompts")
    assert {k: capped[k] for k in keys} == {k: one[k] for k in keys}


def test_an_eval_batch_group_speculates_from_each_prompts_first_token(target, head):
    rng = random.Random(8)
    short = [[rng.randrange(2, 320) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    prompts = short + _long_prompts(6, seed=6)  # the second batch group alone is over 2,048 tokens
    spec = SpecConfig(method="chain", k=3, head=head)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    grouped = _engine(target, None, prompts, EvalPlan(heads=[], batch_size=6, max_tokens=12), spec)
    outs = [o for i in (0, 6) for o in grouped.generate(prompts[i:i + 6], params)]
    alone = _engine(target, None, prompts, EvalPlan(heads=[], batch_size=1, max_tokens=12), spec)
    singles = [alone.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in outs] == [o.token_ids for o in singles]
    assert [o.spec_metrics["steps"] for o in outs] == [o.spec_metrics["steps"] for o in singles]
    assert [o.spec_metrics["accept_histogram"] for o in outs] == [o.spec_metrics["accept_histogram"] for o in singles]


def test_the_one_step_prefill_budget():
    assert one_step_prefill_budget([[0] * 100], default=2048) == 2048
    assert one_step_prefill_budget([[0] * 3000] + [[0] * 1000] * 4, 1, default=2048) == 3000
    assert one_step_prefill_budget([[0] * 1000] * 5 + [[0] * 10], 3, default=2048) == 3000  # groups of 3
    assert one_step_prefill_budget([[0] * 1000] * 5, default=2048) == 5000  # one group: all of them
    assert one_step_prefill_budget([[0] * (MEASURED_PREFILL_CAP + 5)]) == MEASURED_PREFILL_CAP == 16_384
    assert one_step_prefill_budget([[0] * 900], default=512, cap=600) == 600
    assert one_step_prefill_budget([], default=512) == 512


def test_kv_pages_for_the_longest_requests_that_run_together(target, head):
    # (500 + 27 + 4 + 1) / 16 -> 34 pages + 1; (100 + 27 + 5) / 16 -> 9 + 1; + 8
    assert kv_pages_for([[0] * 100, [0] * 10, [0] * 500], max_tokens=27, batch=2, lookahead=4) == 35 + 10 + 8
    assert kv_pages_for([[0] * 10] * 3, 5, batch=9) == 3 * 2 + 8  # a batch over the prompts: all of them
    assert kv_pages_for([[0] * 500], 1000, 1, context=512) == 33 + 1 + 8  # the engine stops at the context
    # eval's engine: a batch of 4 sized by the longest prompt and the 3 next longest, not 4 x the longest
    prompts = [[5] * 400] + [[5] * 10] * 6
    plan = EvalPlan(heads=[], batch_size=4, max_tokens=12)
    engine = _engine(target, None, prompts, plan, SpecConfig(method="chain", k=3, head=head))
    assert engine.allocator.num_pages == (-(-417 // 16) + 1) + 3 * (-(-27 // 16) + 1) + 8 < 4 * 28 + 8


def _spec_engine(target, head, **kw):
    from headstart.inference import Engine

    return Engine(target, device="cpu", spec=SpecConfig(method="chain", k=3, head=head), **kw)


def _traces(outs):
    return [(o.token_ids, o.spec_metrics["steps"], o.spec_metrics["accept_histogram"]) for o in outs]


def test_an_engine_under_a_small_token_budget_speculates_from_each_prompts_first_token(target, head):
    """The engine itself, not only its measuring callers: prompts prefilled in chunks over several steps (a
    budget of 400 tokens) give each sequence the trace it has alone, because those prefilled first wait."""
    prompts = _long_prompts(4, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    chunked = _spec_engine(target, head, max_batched_tokens=400).generate(prompts, params)
    singles = [_spec_engine(target, head).generate([p], params)[0] for p in prompts]
    assert _traces(chunked) == _traces(singles)


def test_a_request_arriving_mid_generation_leaves_the_others_traces_alone(target, head):
    prompts = _long_prompts(3, seed=10)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    engine = _spec_engine(target, head, max_batched_tokens=300)
    for i, p in enumerate(prompts[:2]):
        engine.add_request(p, params, request_id=str(i))
    done = {}
    for step in range(10_000):  # a bound, not a timing: the engine must finish
        if step == 3:
            engine.add_request(prompts[2], params, request_id="2")
        done.update({o.id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished():
            break
    singles = [_spec_engine(target, head).generate([p], params)[0] for p in prompts]
    assert _traces([done[str(i)] for i in range(3)]) == _traces(singles)


def _bounded(engine, prompts, params, max_steps=10_000):
    """generate() with a step bound: a scheduler that picks nothing forever fails here instead of hanging."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    for _ in range(max_steps):
        done.update({o.id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished():
            return [done[i] for i in ids]
    raise AssertionError(f"not finished after {max_steps} steps")


def test_held_sequences_still_run_when_no_prefill_fits(target, head):
    """A waiting prompt the KV cache cannot admit until a running one finishes: the running ones must not be
    held for it (the scheduler never picks nothing)."""
    prompts = _long_prompts(2, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    pages = -(-(max(map(len, prompts)) + 8 + 4 + 1) // 16) + 2  # room for one sequence at a time
    outs = _bounded(_spec_engine(target, head, page_size=16, num_pages=pages, max_batched_tokens=300), prompts, params)
    singles = [_spec_engine(target, head).generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in outs] == [o.token_ids for o in singles]
