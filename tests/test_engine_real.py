"""The engine on the real SmolLM2-135M (fp32): greedy continuations token-identical to HF generate,
alone and in one continuous batch of mixed lengths; the CLI end to end."""

import json
import sys
from pathlib import Path

import pytest
import torch

from headstart.cli import main

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # last: installed packages win

pytestmark = pytest.mark.real
N_TOKENS = 24


@pytest.fixture(scope="module")
def setup():
    from common import sharegpt_prompts
    from transformers import AutoModelForCausalLM

    from headstart.assets import resolve_model
    from headstart.inference import Engine

    model_dir = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    engine = Engine(str(model_dir), dtype="fp32", max_batch_size=8)
    prompts = [engine.encode(m) for m in sharegpt_prompts(4, max_chars=400)]
    refs = []
    for p in prompts:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), max_new_tokens=N_TOKENS, do_sample=False, pad_token_id=2)
        refs.append(out[0, len(p):].tolist())
    return engine, prompts, refs


def test_greedy_identical_to_hf_alone(setup):
    from headstart.inference import SamplingParams

    engine, prompts, refs = setup
    for p, ref in zip(prompts, refs):
        assert engine.generate([p], SamplingParams(max_tokens=N_TOKENS))[0].token_ids == ref


def test_greedy_identical_to_hf_in_one_batch(setup):
    from headstart.inference import SamplingParams

    engine, prompts, refs = setup
    assert len({len(p) for p in prompts}) > 1  # mixed lengths
    outs = engine.generate(prompts, SamplingParams(max_tokens=N_TOKENS))
    assert [o.token_ids for o in outs] == refs
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_cli_generate_json(capsys):
    assert main(["generate", "--prompt", "Write a haiku about the sea", "--max-tokens", "16", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["id"] == "0" and len(lines[0]["token_ids"]) <= 16 and lines[0]["text"]
    assert set(lines[1]) == {"tokens_per_s", "generated_tokens", "seconds"}


def test_cli_generate_prompts_file(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt": "Say hi", "category": "chat"}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "Count to three"}]}) + "\n")
    assert main(["generate", "--prompts", str(f), "--max-tokens", "8", "--json", "--temperature", "0.7",
                 "--top-p", "0.9", "--seed", "3"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x.get("id") for x in lines[:2]] == ["a", "p-2"]  # rows without an id: <file stem>-<line>
    assert main(["generate", "--prompt", "x", "--top-p", "1.5"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
