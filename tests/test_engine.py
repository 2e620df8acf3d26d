import json
import random

import pytest
import torch
from conftest import make_tokenizer
from tiny_models import make_hf_model

from headstart.errors import AssetError
from headstart.inference import Engine, SamplingParams
from headstart.models.llama import load_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf_model("llama", d, seed=4)
    return hf, d


def _engine(d, **kw):
    kw.setdefault("page_size", 4)
    return Engine(load_llama(d, "fp32"), dtype="fp32", **kw)


def _prompts(n, seed=0, lo=1, hi=30, vocab=320):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_hf_alone_and_batched(tiny):
    hf, d = tiny
    prompts = _prompts(5, seed=1)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    refs = [_hf_greedy(hf, p, 12) for p in prompts]
    alone = [_engine(d).generate([p], params)[0].token_ids for p in prompts]
    together = [o.token_ids for o in _engine(d, max_batch_size=8).generate(prompts, params)]
    assert alone == refs
    assert together == refs


def test_load_with_preemption_is_exact_and_leaks_nothing(tiny):
    _, d = tiny
    rng = random.Random(7)
    prompts = _prompts(200, seed=2, lo=1, hi=24)
    params = [SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True) for _ in prompts]
    # Each request needs <= 40 tokens = 10 pages; 200 of them need ~900 pages; give the cache 1/4 of that.
    need = sum(-(-(len(p) + sp.max_tokens) // 4) for p, sp in zip(prompts, params))
    eng = _engine(d, num_pages=need // 4, max_batch_size=64, max_batched_tokens=256)
    free0 = eng.allocator.num_free
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert eng.stats.preemptions > 0  # the cache really was too small for everything at once
    assert eng.allocator.num_free == free0
    solo = _engine(d, max_batch_size=1)
    ref = [o.token_ids for o in solo.generate(prompts, params)]
    assert got == ref
    assert [len(t) for t in got] == [sp.max_tokens for sp in params]


def test_sampling_is_seeded_and_independent_of_the_batch(tiny):
    _, d = tiny
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    together = [o.token_ids for o in _engine(d).generate(prompts, params)]
    alone = [_engine(d).generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone
    assert len({tuple(t) for t in together}) == 4


def test_stop_conditions(tiny):
    _, d = tiny
    prompt = _prompts(1, seed=4)[0]
    eng = _engine(d)
    free = eng.allocator.num_free
    base = eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 8
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    out = eng.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    assert eng.allocator.num_free == free


def test_stop_strings_and_text(tmp_path):
    tok = make_tokenizer("chatml")
    d = tmp_path / "m"
    make_hf_model("llama", d, seed=5, vocab_size=len(tok))
    eng = Engine(load_llama(d), tokenizer=tok, page_size=4)
    base = eng.generate(["Hello"], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert base.text == tok.decode(base.token_ids, skip_special_tokens=True)
    stop = base.text[3:6]
    if not stop.strip():
        pytest.skip("degenerate random text")
    out = eng.generate(["Hello"], SamplingParams(max_tokens=10, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == base.text[: base.text.find(stop)]
    # The prompt went through the chat template.
    assert tok.decode(out.prompt_ids).endswith("<|im_start|>assistant\n")


def test_abort_frees_pages(tiny):
    _, d = tiny
    eng = _engine(d)
    free = eng.allocator.num_free
    a = eng.add_request(_prompts(1, seed=5)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request(_prompts(1, seed=6)[0], SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    assert eng.abort(a) and not eng.abort("nope") and not eng.abort(a)
    finished = {}
    while eng.has_unfinished():
        finished.update({o.id: o for o in eng.step() if o.finished})
    assert finished[b].finish_reason == "length" and a not in finished
    assert eng.allocator.num_free == free
    assert not eng._seqs  # a server loop of add_request/step/abort keeps nothing per finished request


def test_streaming_callback(tiny):
    _, d = tiny
    seen = []
    out = _engine(d).generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True),
                              on_output=lambda o: seen.extend(o.new_token_ids))
    assert seen == out[0].token_ids


def test_bad_requests(tiny):
    _, d = tiny
    eng = _engine(d, num_pages=8)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="context is 512"):
        eng.add_request([3] * 600, SamplingParams())
    with pytest.raises(ValueError, match="KV pages"):
        eng.add_request([3] * 40, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request([3, 999], SamplingParams())
    with pytest.raises(ValueError, match="no tokenizer"):
        eng.add_request("text", SamplingParams())


def test_bad_model_directories(tiny, tmp_path):
    _, d = tiny
    with pytest.raises(AssetError, match="unknown model"):
        Engine(str(tmp_path / "nowhere"))
    cfg = json.loads((d / "config.json").read_text())
    bad = tmp_path / "bad-type"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(AssetError, match="model_type 'gpt2' is not supported"):
        load_llama(bad)
    from safetensors.torch import load_file, save_file

    weights = load_file(d / "model.safetensors")
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}, missing / "model.safetensors")
    with pytest.raises(AssetError, match=r"lack tensors for: model.layers.1.mlp.gate_up_proj.weight"):
        load_llama(missing)
    shaped = tmp_path / "shaped"
    shaped.mkdir()
    (shaped / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    save_file(weights, shaped / "model.safetensors")
    with pytest.raises(AssetError, match=r"mlp\.(down|gate|up)_proj\.weight' has shape .* the model expects"):
        load_llama(shaped)


def test_sharded_checkpoint(tmp_path):
    d = tmp_path / "sharded"
    hf = make_hf_model("qwen2", tmp_path / "one", seed=1)
    hf.save_pretrained(d, max_shard_size="50KB")
    assert (d / "model.safetensors.index.json").exists()
    prompt = [[4, 5, 6, 7]]
    a = Engine(load_llama(tmp_path / "one")).generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    b = Engine(load_llama(d)).generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    assert a[0].token_ids == b[0].token_ids
