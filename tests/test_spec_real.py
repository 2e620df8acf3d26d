"""Speculation on the real SmolLM2-135M (fp32): a head that was never trained (initialised from the
target) and a stand-in draft model still give exactly the target's greedy text, only slower."""

import json
import sys
from pathlib import Path

import pytest

from headstart.cli import main

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # last: installed packages win
pytestmark = pytest.mark.real
N_TOKENS = 20


@pytest.fixture(scope="module")
def setup():
    from common import sharegpt_prompts

    from headstart.assets import resolve_model
    from headstart.inference import Engine, SamplingParams
    from headstart.models.llama import load_llama

    target = load_llama(resolve_model("smollm2-135m"), "fp32")
    engine = Engine(target, dtype="fp32")
    prompts = [engine.encode(m) for m in sharegpt_prompts(3, max_chars=300)]
    ref = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=N_TOKENS))]
    return target, prompts, ref


@pytest.mark.parametrize("method", ["chain", "tree", "draft", "medusa"])
def test_untrained_proposers_are_lossless_on_smollm2(setup, method):
    from headstart.heads import HeadConfig, build_head
    from headstart.inference import Engine, SamplingParams
    from headstart.inference.speculation import SpecConfig

    target, prompts, ref = setup
    kind = {"chain": "mtp", "tree": "mtp", "draft": "draft_lm", "medusa": "medusa"}[method]
    head = build_head(HeadConfig(head_type=kind, num_layers=4 if kind == "draft_lm" else 1), target)
    spec = SpecConfig(method=method, k=3, head=head if method != "draft" else None,
                      draft=head if method == "draft" else None, tree_topk=3, tree_tokens=8)
    engine = Engine(target, dtype="fp32", spec=spec)
    outs = engine.generate(prompts, SamplingParams(max_tokens=N_TOKENS))
    assert [o.token_ids for o in outs] == ref
    assert engine.spec_metrics.summary()["steps"] > 0


def test_cli_spec_chain_json(tmp_path, capsys):
    head_dir = tmp_path / "mtp"
    assert main(["head", "init", "--type", "mtp", "--out", str(head_dir)]) == 0
    capsys.readouterr()
    assert main(["generate", "--prompt", "Name three colors.", "--max-tokens", "12", "--json", "--dtype", "fp32",
                 "--spec", "chain", "--head", str(head_dir), "--k", "3"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    summary = lines[-1]
    for key in ("tau", "alpha", "accept_rate_per_pos", "cond_accept_per_pos", "accept_histogram", "tokens_per_s"):
        assert key in summary
    assert len(summary["accept_rate_per_pos"]) == 3 and "tau" in lines[0]


@pytest.mark.real
def test_the_shipped_head_speculates_losslessly():
    """assets/heads/smollm2-135m-mtp loads on the embedded target (fingerprint and weights checked)
    and drafts tokens the engine accepts, with output identical to plain decoding."""
    from headstart.inference import Engine, SamplingParams
    from headstart.inference.speculation import SpecConfig

    head = Path(__file__).resolve().parents[1] / "assets" / "heads" / "smollm2-135m-mtp"
    dtype = "fp32"  # exact equality with plain decoding: bf16 verify rows may round a near-tie differently
    prompts = ["Write a haiku about the sea", "What is speculative decoding?"]
    params = SamplingParams(max_tokens=24)
    ref = [o.token_ids for o in Engine("smollm2-135m", dtype=dtype).generate(prompts, params)]
    eng = Engine("smollm2-135m", dtype=dtype, spec=SpecConfig(method="chain", k=3, head=str(head)))
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.spec_metrics.summary()["alpha"] > 0
