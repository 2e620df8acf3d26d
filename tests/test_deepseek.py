"""DeepSeek targets (headstart.models.deepseek) against transformers' own DeepseekV2 / DeepseekV3
classes on tiny random configs built here: prefill logits (packed sequences) and greedy decoding
through the engine's paged latent cache, fp32; with and without q LoRA, greedy / group-limited /
noaux_tc routing, dense first layers, YaRN, and the refusals of what is not supported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headstart.errors import AssetError
from headstart.models import load_target
from headstart.models.deepseek import DeepseekConfig, DeepseekForCausalLM
from headstart.nn.attention import PackedCausalAttention, packed_metadata

ROOT = Path(__file__).resolve().parents[1]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
# Unequal mscales (the attention factor and the softmax scale both != 1) and an untruncated ramp.
YARN_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}
COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=12,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
              max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
CONFIGS = {
    # DeepSeek-V2-Lite's shape: no q LoRA, greedy softmax routing, a dense first layer
    "v2-lite": ("v2", dict(q_lora_rank=None, topk_method="greedy")),
    # DeepSeek-V2's: q LoRA, group-limited routing (4 groups, the 2 best), routed scaling, YaRN
    "v2-grouped": ("v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=2.0, rope_parameters=YARN)),
    # DeepSeek-V3's: q LoRA, sigmoid + bias-corrected noaux_tc over groups, renormalised, YaRN
    "v3": ("v3", dict(q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                      rope_parameters=YARN_V3)),
    # V3 with rope_interleave false, two dense layers, no q LoRA
    "v3-plain-rope": ("v3", dict(q_lora_rank=None, n_group=4, topk_group=2, rope_interleave=False,
                                 first_k_dense_replace=2)),
}


def _hf_model(kind, overrides, seed=0):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    cls_cfg, cls = (DeepseekV2Config, DeepseekV2ForCausalLM) if kind == "v2" else (DeepseekV3Config,
                                                                                    DeepseekV3ForCausalLM)
    cfg = cls_cfg(**{**COMMON, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # every weight random and of a size that keeps the logits informative
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08 if "gate.weight" in name else 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(-1 + 0.3 * torch.randn_like(b))  # negative choices: masked groups must be -inf
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    kind, overrides = CONFIGS[request.param]
    hf = _hf_model(kind, overrides)
    d = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    hf.save_pretrained(d)
    hf.generation_config.eos_token_id = None  # generate as ignore_eos does
    return request.param, hf, load_target(d, "fp32")


def _prompts():
    return [[(11 * i + 5 * j) % 150 + 3 for j in range(5 + 4 * i)] for i in range(4)]


def test_prefill_logits_equal_transformers(pair):
    name, hf, ours = pair
    assert isinstance(ours, DeepseekForCausalLM)
    prompts = _prompts()
    flat = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad():
        h, _ = ours(flat, packed_metadata([len(p) for p in prompts]), [None] * ours.num_layers,
                    PackedCausalAttention())
        got = ours.compute_logits(h)
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4, msg=name)


def test_training_runs_mla_expanded_and_equals_the_absorbed_form(pair):
    """Training backends (no latent cache) get MLA as written: per-head keys of qk_head_dim and values of
    v_head_dim (padded to one width for the fused kernels), not the latent's rank + rope; the hidden
    states and gradients equal the absorbed form's, which the engine's decode keeps."""
    name, _, ours = pair
    prompts = _prompts()
    flat = torch.tensor([t for p in prompts for t in p])
    meta = packed_metadata([len(p) for p in prompts])
    widths = []

    class Absorbed(PackedCausalAttention):
        expands_mla = False

        def forward(self, q, k, v, cache, meta, scale):
            widths.append(q.shape[-1])
            return super().forward(q, k, v, cache, meta, scale)

    class Expanded(Absorbed):
        expands_mla = True

    def run(backend):
        ours.zero_grad(set_to_none=True)
        h, _ = ours(flat, meta, [None] * ours.num_layers, backend)
        (h * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
        return h.detach(), [p.grad.clone() for p in ours.parameters() if p.grad is not None]

    frozen = {n: p.requires_grad for n, p in ours.named_parameters()}
    ours.requires_grad_(True)
    try:
        got, want = run(Expanded()), run(Absorbed())
    finally:
        for n, p in ours.named_parameters():
            p.requires_grad_(frozen[n])
            p.grad = None
    cfg = ours.config
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert widths == [max(qk, cfg.v_head_dim)] * cfg.num_hidden_layers + [cfg.kv_lora_rank + cfg.qk_rope_head_dim] * \
        cfg.num_hidden_layers, name
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5, msg=name)
    assert len(got[1]) == len(want[1]) > 0
    for x, y in zip(got[1], want[1]):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-5, msg=name)


def test_greedy_decoding_through_the_latent_cache_equals_transformers(pair):
    """Chunked prefill, batching over pages of 4 and one-token decode steps, against HF's generate."""
    from headstart.inference import Engine, SamplingParams

    name, hf, ours = pair
    prompts = _prompts()
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 6, 12, 7)]
    eng = Engine(ours, page_size=4, num_pages=64, max_batch_size=3, max_batched_tokens=8)
    got = [o.token_ids for o in eng.generate(prompts, params)]
    for p, sp, tokens in zip(prompts, params, got):
        out = hf.generate(torch.tensor([p]), max_new_tokens=sp.max_tokens, do_sample=False, pad_token_id=0)
        assert tokens == out[0, len(p):].tolist(), name
    spec = eng.cache.spec
    assert spec.shared and spec.num_kv_heads == 1 and spec.head_dim == 16 + 8
    k, v = eng.cache.layers[0]
    assert k is v  # one latent tensor per layer: the keys and the values


def test_the_engine_prefills_whole_prompts_expanded_and_still_equals_transformers(pair, monkeypatch):
    """A step of whole prompts runs MLA expanded (as serving engines prefill) and writes the latent rows decode
    reads: greedy tokens equal HF's; chunks after the first and decode steps run absorbed, and so does every
    step of a batch-invariant engine (its row-invariant kernels take every row)."""
    from headstart.inference import Engine, SamplingParams
    from headstart.models.deepseek_mla import MLAttention

    name, hf, ours = pair
    calls = []
    real = MLAttention._expanded
    monkeypatch.setattr(MLAttention, "_expanded", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    prompts = _prompts()
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 6, 12, 7)]
    eng = Engine(ours, page_size=4, num_pages=64, max_batch_size=4, max_batched_tokens=64, batch_invariant=False)
    got = [o.token_ids for o in eng.generate(prompts, params)]
    for p, sp, tokens in zip(prompts, params, got):
        out = hf.generate(torch.tensor([p]), max_new_tokens=sp.max_tokens, do_sample=False, pad_token_id=0)
        assert tokens == out[0, len(p):].tolist(), name
    assert calls == [sum(map(len, prompts))] * ours.config.num_hidden_layers, calls  # the prefill step only
    # Chunked: only a prompt's first chunk (nothing cached before it) runs expanded; a later chunk attends to its
    # cached prefix too, absorbed.
    calls.clear()
    chunked = Engine(ours, page_size=4, num_pages=64, max_batch_size=3, max_batched_tokens=8, batch_invariant=False)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == got
    assert 0 < len(calls) < 4 * ours.config.num_hidden_layers
    calls.clear()
    invariant = Engine(ours, page_size=4, num_pages=64, max_batch_size=4, max_batched_tokens=64)
    assert [o.token_ids for o in invariant.generate(prompts, params)] == got and calls == []


def test_prompt_lookup_speculation_is_lossless_on_a_deepseek_target(pair):
    """Verify steps of k + 1 rows write and roll back latent rows as decode steps do: the tokens of
    ngram speculation equal plain greedy decoding."""
    from headstart.inference import Engine, SamplingParams
    from headstart.inference.speculation import SpecConfig

    name, _, ours = pair
    prompts = [p * 3 for p in _prompts()]  # repeats, so the lookup proposes
    params = [SamplingParams(max_tokens=10, ignore_eos=True) for _ in prompts]
    plain = Engine(ours, page_size=4, num_pages=96, max_batch_size=4).generate(prompts, params)
    eng = Engine(ours, page_size=4, num_pages=96, max_batch_size=4, spec=SpecConfig(method="ngram", k=3))
    spec = eng.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain], name


def _config(**changes):
    from transformers import DeepseekV3Config

    raw = DeepseekV3Config(**{**COMMON, "q_lora_rank": 24, "n_group": 2, "topk_group": 1}).to_dict()
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes, named", [
    ({"scoring_func": "tanh"}, "scoring_func"),
    ({"topk_method": "random"}, "topk_method"),
    ({"hidden_act": "relu6"}, "hidden_act"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 5}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "RoPE scaling 'dynamic'"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"q_lora_rank": 0}, "q_lora_rank = 0"),
    ({"v_head_dim": None}, "v_head_dim = None"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok is not set"),
    ({"n_group": None}, "n_group is not set"),
])
def test_what_is_not_supported_is_refused_by_name(changes, named):
    raw = _config(**changes)
    if changes.get("kv_lora_rank", 0) is None:
        raw.pop("kv_lora_rank")
    with pytest.raises(AssetError, match=named):
        DeepseekConfig.from_hf(raw, where="x/config.json")


def test_the_latent_cache_is_what_mla_needs_per_token():
    cfg = DeepseekConfig.from_hf(_config(), where="config.json")
    assert cfg.latent_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    # DeepSeek-V3's shape: 576 values per token and layer, against 2 x 128 x (192 + 128) / 2 expanded
    v3 = DeepseekConfig.from_hf(_config(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                        v_head_dim=128, num_attention_heads=128), where="config.json")
    assert v3.latent_dim == 576


def test_a_model_too_large_for_the_machine_is_refused_before_allocating(tmp_path):
    raw = _config(vocab_size=10_000_000, hidden_size=65536)  # ~1.3 T embedding parameters
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(AssetError, match="the weights need .* GB"):
        load_target(tmp_path, "fp32")


def test_parameter_count_is_the_built_model(pair):
    _, _, ours = pair
    assert ours.config.parameter_count() == sum(p.numel() for p in ours.parameters())


# ------------------------------------------------------------------------------ deepseek_mtp heads


def _mtp_head(target, **kw):
    from headstart.heads import HeadConfig, build_head

    return build_head(HeadConfig(head_type="deepseek_mtp", **kw), target).eval()


def test_a_head_built_without_the_targets_weights_starts_from_a_linear_init(pair):
    """kv_b_proj and the router hold their weights outside a Linear: built without the target's weights
    (init_from_target false, or a rank that waits for rank 0's head) they must not be torch.empty's
    leftovers, which trained on NaN / 1e34 entries in a 2-rank DDP run."""
    from headstart.heads import HeadConfig, build_head

    name, _, ours = pair
    torch.manual_seed(0)
    head = build_head(HeadConfig(head_type="deepseek_mtp"), ours, init_from_target=False)
    attn, mlp = head.layers[0].self_attn, head.layers[0].mlp
    for w in (attn.kv_b_proj.weight, mlp.gate.weight):
        bound = 1 / w.shape[1] ** 0.5  # nn.Linear's: kaiming uniform with a = sqrt(5)
        assert torch.isfinite(w).all() and w.abs().max() <= bound and w.std() > bound / 4, name


def test_a_deepseek_mtp_head_has_the_targets_own_block(pair):
    """MLA always; the MoE MLP where the target routes experts at the MTP layer's index (the tiny
    targets from layer 1 or 2 on), a dense one with dense_block; copied from the last target layer."""
    from headstart.models.deepseek import MoE
    from headstart.models.deepseek_mla import MLAttention
    from headstart.nn.mlp import GatedMLP

    name, _, ours = pair
    head = _mtp_head(ours)
    layer = head.layers[0]
    assert isinstance(layer.self_attn, MLAttention) and isinstance(layer.mlp, MoE), name
    last = ours.model.layers[-1]
    for (n, p), (_, q) in zip(layer.named_parameters(), last.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)
    dense = _mtp_head(ours, dense_block=True)
    assert isinstance(dense.layers[0].mlp, GatedMLP)
    assert (head.cache_heads, head.cache_head_dim, head.cache_shared) == (1, ours.config.latent_dim, True)
    # The copied block computes what the target's last layer computes (its RoPE, YaRN included).
    x = torch.randn(9, ours.config.hidden_size)
    with torch.no_grad():
        a = layer(x, packed_metadata([9]), None, PackedCausalAttention())
        b = last(x, packed_metadata([9]), None, PackedCausalAttention())
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # the target may run its kernel path, the head einsums
    from headstart.inference.kv_cache import KVCacheSpec, pages_for_budget
    from headstart.inference.proposers import draft_kv_spec

    spec = draft_kv_spec(head)
    assert spec.shared and spec.num_kv_heads == 1 and spec.head_dim == ours.config.latent_dim
    assert spec.bytes_per_page(4) == 1 * 4 * ours.config.latent_dim * 4  # one layer, one tensor, fp32
    target_spec = KVCacheSpec.of(ours)
    assert pages_for_budget(1.0, [target_spec], 4) == int(1024**3 // (ours.num_layers * 4 * ours.config.latent_dim
                                                                        * 4))


def test_the_unrolled_mla_head_is_the_engine_draft_step(pair):
    """TTT's unroll over an MLA block (latent keys expanded to every head) computes, at every draft
    position, what the engine's draft steps compute through the paged latent cache."""
    from headstart.heads import PackedBatch
    from headstart.inference.backends import TorchAttention
    from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator
    from headstart.inference.runner import build_metadata
    from headstart.train.module import target_forward
    from headstart.train.ttt import unroll

    name, _, ours = pair
    head = _mtp_head(ours)
    g = torch.Generator().manual_seed(1)
    lens = (7, 16, 5)
    b = target_forward(ours, PackedBatch(torch.randint(2, 150, (sum(lens),), generator=g), list(lens), None, None,
                                         None), [])
    steps = 3
    with torch.no_grad():
        outs, _, sh = unroll(head, b, steps)
    first = 6
    feats = head.target_features(b.hidden[sh.src_rows])[first:first + 15]
    tokens = sh.tokens[first:first + 15]
    alloc = PageAllocator(32, 4)
    cache = KVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=head.cache_head_dim, dtype=torch.float32,
                                shared=True), 32, 4, "cpu")
    m = 8
    alloc.reserve("s", m + steps + 1)
    with torch.no_grad():
        meta = build_metadata(alloc, [("s", 0, m + 1)], torch.device("cpu"))
        h, _ = head.draft_step(tokens[:m + 1], feats[:m + 1], meta, cache.layers, TorchAttention())
        torch.testing.assert_close(h[-1], outs[0][first + m], rtol=1e-4, atol=1e-4, msg=name)
        own = h[-1:]
        for j in range(1, steps):
            meta = build_metadata(alloc, [("s", m + j, m + j + 1)], torch.device("cpu"))
            own, _ = head.draft_step(tokens[m + j:m + j + 1], own, meta, cache.layers, TorchAttention())
            torch.testing.assert_close(own[0], outs[j][first + m + j], rtol=1e-4, atol=1e-4, msg=name)


def test_chain_speculation_with_an_mla_head_is_lossless(pair):
    from headstart.inference import Engine, SamplingParams
    from headstart.inference.speculation import SpecConfig

    name, _, ours = pair
    head = _mtp_head(ours)
    prompts = _prompts()
    params = [SamplingParams(max_tokens=10, ignore_eos=True) for _ in prompts]
    plain = Engine(ours, page_size=4, num_pages=96, max_batch_size=4).generate(prompts, params)
    eng = Engine(ours, page_size=4, num_pages=96, max_batch_size=4, spec=SpecConfig(method="chain", k=3, head=head))
    spec = eng.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain], name
    assert eng.spec_metrics.summary()["steps"] > 0


def test_other_heads_on_a_deepseek_target_are_refused_by_name(pair):
    from headstart.heads import HeadConfig, build_head

    _, _, ours = pair
    with pytest.raises(AssetError, match="train a deepseek_mtp head"):
        build_head(HeadConfig(head_type="eagle3"), ours)


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def tiny_v3_dir(tmp_path_factory):
    """A tiny random DeepSeek-V3 directory with the ChatML tiny tokenizer (as recipes/deepseek-tiny-mtp.yaml
    describes)."""
    from conftest import make_tokenizer

    tok = make_tokenizer("chatml")
    kind, overrides = CONFIGS["v3"]
    hf = _hf_model(kind, {**overrides, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                          "bos_token_id": tok.bos_token_id or 0})
    d = tmp_path_factory.mktemp("deepseek-tiny")
    hf.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_the_tiny_deepseek_recipe_runs_end_to_end(tiny_v3_dir, tmp_path, capsys):
    """precompute -> train (shards, TTT 2, engine validation) -> export deepseek-mtp -> import -> eval,
    then the same MTP layer imported from inside the target's own checkpoint (as DeepSeek-V3 ships it)."""
    from conftest import random_conversations, write_jsonl
    from safetensors.torch import load_file, save_file

    from headstart.cli import main
    from headstart.heads import load_head

    data = tmp_path / "chats.jsonl"
    write_jsonl(data, random_conversations(48, 0, max_rounds=2, user_words=(2, 10), reply_words=(4, 24)))
    recipe = ROOT / "recipes" / "deepseek-tiny-mtp.yaml"
    sets = ["--set", f"target.model={tiny_v3_dir}", "--set", f"data.source={data}", "--set",
            f"output_dir={tmp_path / 'run'}"]
    assert main(["precompute", str(recipe), *sets]) == 0
    assert main(["train", str(recipe), *sets, "--no-progress"]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["tau"] >= 1.0 and len(metrics["top1_per_step"]) == 2
    head_dir = tmp_path / "run" / "head-final"
    export = tmp_path / "export"
    assert main(["export", str(head_dir), "--format", "deepseek-mtp", "--model", str(tiny_v3_dir),
                 "--out", str(export)]) == 0
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    names = set(load_file(str(export / "model.safetensors")))
    assert "model.layers.3.self_attn.kv_b_proj.weight" in names and "model.layers.3.mlp.experts.7.up_proj.weight" \
        in names and "model.layers.3.eh_proj.weight" in names
    assert main(["import", str(export), "--format", "deepseek-mtp", "--target", str(tiny_v3_dir),
                 "--out", str(tmp_path / "imported")]) == 0
    target = load_target(tiny_v3_dir, "fp32")
    a, b = load_head(head_dir, target), load_head(tmp_path / "imported", target)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y.to(x.dtype), msg=name)
    capsys.readouterr()
    assert main(["eval", str(recipe), *sets, "--head", str(tmp_path / "imported"), "--k", "1,2", "--heldout", "3",
                 "--max-tokens", "8", "--no-progress", "--out", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    rows = [r for r in report["runs"] if r.get("k") in (1, 2)]
    assert rows and all(r["lossless_check"] == "identical" for r in rows)

    # DeepSeek-V3 ships its MTP layer inside the checkpoint, after the decoder layers: a copy of the
    # target directory with the exported layer's tensors beside its own imports as the same head.
    shipped = tmp_path / "v3-with-mtp"
    shipped.mkdir()
    for f in tiny_v3_dir.iterdir():
        if f.name != "model.safetensors":
            (shipped / f.name).write_bytes(f.read_bytes())
    own = load_file(str(tiny_v3_dir / "model.safetensors"))
    mtp = load_file(str(export / "model.safetensors"))
    save_file(own, str(shipped / "model-00001-of-00002.safetensors"))
    save_file(mtp, str(shipped / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in own} | {
        k: "model-00002-of-00002.safetensors" for k in mtp}
    (shipped / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = json.loads((shipped / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (shipped / "config.json").write_text(json.dumps(cfg))
    assert main(["import", str(shipped), "--format", "deepseek-mtp", "--target", str(tiny_v3_dir),
                 "--out", str(tmp_path / "from-checkpoint")]) == 0
    c = load_head(tmp_path / "from-checkpoint", target)
    for (name, x), (_, y) in zip(a.state_dict().items(), c.state_dict().items()):
        torch.testing.assert_close(x, y.to(x.dtype), msg=name)


def test_with_the_cpu_kernels_a_tokens_logits_do_not_depend_on_its_batch(tmp_path):
    """The engine's row-invariant path (per-head absorbed projections, the fp32 router, experts,
    attention): each prompt's logits alone equal, bit for bit, its rows in a batch of four. At this
    size the batched einsums of training are not row-invariant in fp32 (one row alone, a decode step,
    gets other bits), nor is torch's fp32 sigmoid over 16 experts (a vector tail), which is why the
    engine uses neither."""
    from headstart.inference.backends import TorchAttention
    from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator
    from headstart.inference.runner import build_metadata

    hf = _hf_model("v3", dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192,
                              kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                              n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2))
    hf.save_pretrained(tmp_path)
    model = load_target(tmp_path, "fp32")
    got = model.enable_cpu_kernels(True, None)
    assert got and all(k == "rows" for k in got)
    backend = TorchAttention(rowwise=True, max_rows=None)

    def logits(prompts):
        alloc = PageAllocator(64, 16)
        cache = KVCache(KVCacheSpec.of(model), 64, 16, "cpu")
        for i, p in enumerate(prompts):
            alloc.reserve(str(i), len(p))
        meta = build_metadata(alloc, [(str(i), 0, len(p)) for i, p in enumerate(prompts)], torch.device("cpu"))
        with torch.inference_mode():
            h, _ = model(torch.tensor([t for p in prompts for t in p]), meta, cache.layers, backend)
            return model.compute_logits(h)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 8000, (n,), generator=g).tolist() for n in (37, 64, 1, 11)]  # 1: a decode-sized step
    together = logits(prompts)
    row = 0
    for p in prompts:
        assert torch.equal(logits([p]), together[row:row + len(p)])
        row += len(p)
