"""Acceptance measured the same whatever the batch: eval's batch groups and training's validation prefill
every prompt of a group in one step, so no prompt decodes plainly while the others still prefill."""

import random

import pytest
from tiny_models import make_hf_model

from headstart.evaluate import EvalPlan, _engine
from headstart.heads import HeadConfig, build_head
from headstart.inference import SamplingParams
from headstart.inference.scheduler import MEASURED_PREFILL_CAP, one_step_prefill_budget, prefill_groups
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


def test_validation_in_several_prefill_groups_adds_up_to_one(target, head):
    prompts = _long_prompts(6, seed=7)
    one = engine_acceptance(target, head, prompts, k=3, max_tokens=12)
    split = engine_acceptance(target, head, prompts, k=3, max_tokens=12, prefill_cap=800)  # 2 prompts a group
    assert len(prefill_groups(prompts, 800)) == 3
    keys = ("steps", "accept_histogram", "tau", "accept_rate_per_pos")
    assert {k: split[k] for k in keys} == {k: one[k] for k in keys}


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


def test_prefill_groups_keep_order_and_the_cap():
    lengths = [5, 5, 5, 12, 1, 1]
    groups = prefill_groups([[0] * n for n in lengths], cap=10)
    assert [[len(p) for p in g] for g in groups] == [[5, 5], [5], [12], [1, 1]]  # a longer prompt alone
    assert prefill_groups([], cap=10) == []
    assert one_step_prefill_budget([[[0] * 100]], 2048) == 2048
    assert one_step_prefill_budget([[[0] * 3000], [[0] * 1000] * 4], 2048) == 4000
    assert one_step_prefill_budget([[[0] * (MEASURED_PREFILL_CAP + 5)]], 2048) == MEASURED_PREFILL_CAP == 16_384
    assert one_step_prefill_budget([[[0] * 900]], 512, cap=600) == 600
