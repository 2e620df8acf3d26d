"""`headstart plan`: exact weight and optimizer counts (against real modules), the 8xH100 recipes' verdicts
for H100-80GB with the targets' config.json (recipes/targets/), and the refusals train / precompute make
before loading anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model

from headstart.cli import main
from headstart.heads import HeadConfig, build_head
from headstart.models.llama import load_llama
from headstart.nn.parallel import TensorParallel
from headstart.plan import PlanError, check_fits, make_plan, target_params
from headstart.recipe_io import load_recipe, recipe_from_dict

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {  # recipe: (target config, fits on H100-80GB)
    "llama-3.2-1b-eagle3-8xh100.yaml": ("llama-3.2-1b.json", True),
    "llama-3.1-8b-eagle3-8xh100.yaml": ("llama-3.1-8b.json", True),
    "llama-3.3-70b-eagle3-8xh100.yaml": ("llama-3.3-70b.json", True),
    "deepseek-v2-lite-mtp-8xh100.yaml": ("deepseek-v2-lite.json", True),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan-model")
    make_hf_model("qwen2", d, seed=0, vocab_size=321)
    return d


@pytest.mark.parametrize("tp", [1, 2])
def test_target_weights_are_the_parameters_a_rank_holds(tiny, tp):
    model = load_llama(tiny, "fp32", tp=TensorParallel(0, tp))
    held = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("bias"))
    rank, whole = target_params(model.config, tp)
    # biases (qkv) are not counted; the last rank's vocabulary padding is (ceil(V / tp) rows per rank)
    assert rank == pytest.approx(held, rel=0.002)
    assert whole == sum(p.numel() for n, p in load_llama(tiny, "fp32").named_parameters() if not n.endswith("bias"))


@pytest.mark.parametrize("family", ["mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm"])
def test_the_head_and_optimizer_term_counts_the_real_head(tiny, family):
    cfg = json.loads((tiny / "config.json").read_text())
    recipe = recipe_from_dict({"target": {"model": str(tiny), "dtype": "fp32"},
                               "head": {"type": family, "draft_vocab_size": 64 if family != "draft_lm" else None}})
    plan = make_plan(recipe, cfg)
    train = next(p for p in plan.phases if p.name == "train")
    term = next(t for t in train.terms if t.name == "head weights + grads + AdamW")
    head = build_head(HeadConfig(head_type=family, draft_vocab_size=64 if family != "draft_lm" else None),
                      load_llama(tiny, "fp32"))
    assert term.bytes == 16 * sum(p.numel() for p in head.trainable_parameters())


@pytest.mark.parametrize(("head", "vllm", "sglang"), [
    ({"type": "eagle3"}, "yes (--format vllm)", "head.norm_before_fc"),  # a new eagle3 head: EAGLE-3.1 defaults
    ({"type": "eagle3", "norm_before_fc": False, "norm_before_residual": False}, "yes (--format vllm)",
     "yes (--format sglang)"),
    ({"type": "eagle3", "norm_before_fc": False}, "yes (--format vllm)", "head.norm_before_residual"),
    ({"type": "eagle1"}, "built on Llama layers; this target is 'qwen2'", "yes (--format sglang)"),
    ({"type": "eagle1", "fc_bias": False}, "built on Llama layers", "yes (--format sglang)"),  # a zero bias
    ({"type": "dflash", "draft_vocab_size": 64}, "yes (--format vllm)", "has no lm_head or d2t of its own"),
    ({"type": "dflash"}, "yes (--format vllm)", "yes (--format sglang)"),
    ({"type": "mtp", "draft_vocab_size": 64}, "no place for that vocabulary", "no place for that vocabulary"),
    ({"type": "mtp"}, "vLLM reads no speculators `mtp` config", "DeepSeek MTP loaders"),
    ({"type": "medusa"}, "yes (--format medusa)", "holds a medusa head"),
    ({"type": "draft_lm"}, "yes (--format hf)", "yes (--format hf)"),
])
def test_the_plan_says_where_the_head_serves_as_the_export_decides(tiny, head, vllm, sglang):
    """Each engine's answer is the first of its layouts that takes the head, or the layouts' own refusals."""
    from headstart.export.serving import serving

    if head["type"] in ("eagle3", "dflash"):  # the tiny target's default aux ids include 0, which SGLang cannot name
        head = head | {"aux_layer_ids": [1, 2]}
    cfg = json.loads((tiny / "config.json").read_text())
    recipe = recipe_from_dict({"target": {"model": str(tiny), "dtype": "fp32"}, "head": head})
    plan = make_plan(recipe, cfg)
    lines = dict(line.split(": ", 1) for line in plan.serving)
    assert vllm in lines["vLLM"] and sglang in lines["SGLang"] and lines["headstart"] == "yes (--format native)"
    assert lines["vLLM"].startswith("yes") == ("yes" in vllm)
    built = build_head(HeadConfig(head_type=head["type"], draft_vocab_size=head.get("draft_vocab_size"),
                                  aux_layer_ids=head.get("aux_layer_ids"),
                                  **{k: v for k, v in head.items() if k.startswith("norm") or k == "fc_bias"}),
                      load_llama(tiny, "fp32"))
    assert [s.line() for s in serving(built)] == plan.serving  # the meta-device head answers as the real one


def test_eagle3s_input_norms_add_a_normed_copy_of_the_aux_states_to_the_head_activations(tiny):
    """norm_before_fc and fc_norm each keep a normed copy of the A aux states (A d per token, bf16) for
    backward, on every TTT step; with both off there is none."""
    cfg = json.loads((tiny / "config.json").read_text())

    def activations(**flags):
        recipe = recipe_from_dict({"target": {"model": str(tiny), "dtype": "fp32"},
                                   "head": {"type": "eagle3", "aux_layer_ids": [1, 2], **flags}})
        train = next(p for p in make_plan(recipe, cfg).phases if p.name == "train")
        return recipe.train, next(t.bytes for t in train.terms if t.name == "head activations")

    tr, off = activations(norm_before_fc=False)
    normed_copy = tr.batch_tokens * tr.ttt_steps * 2 * cfg["hidden_size"] * 2
    assert activations()[1] == activations(fc_norm=True)[1] == off + normed_copy


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_8xh100_recipe_gets_its_verdict(recipe, capsys):
    target, fits = RECIPES[recipe]
    rc = main(["plan", str(ROOT / "recipes" / recipe), "--target-config", str(ROOT / "recipes" / "targets" / target)])
    out = capsys.readouterr().out
    assert rc == (0 if fits else 1)
    assert ("fits: every phase" in out) == fits
    for term in ("target weights", "head weights + grads + AdamW", "head activations", "chunked loss", "KV pages"):
        assert term in out
    assert "TTT attention masks" in out  # every 8xH100 recipe unrolls TTT steps
    # every node-sized recipe trains a head that both vLLM and SGLang load for its target (issue 33)
    assert "serves on vLLM: yes" in out and "serves on SGLang: yes" in out, out
    if recipe.startswith("llama-3.3-70b"):  # the target tensor-parallel in training too, the head FSDP-sharded
        train = out.split("train (16 ranks)")[1].split("validation")[0]
        assert "17.64 GB  8.82 B parameters (1/8 tensor-parallel shard)" in train
        assert "/ 16 ranks (FSDP)" in train and "embedding + lm_head (whole)" in train


def test_the_70b_recipe_without_tensor_parallelism_is_refused_by_its_target(capsys):
    rc = main(["plan", str(ROOT / "recipes" / "llama-3.3-70b-eagle3-8xh100.yaml"), "--target-config",
               str(ROOT / "recipes" / "targets" / "llama-3.3-70b.json"), "--tp", "1"])
    out = capsys.readouterr().out
    assert rc == 1 and "train: needs" in out and "'target weights' (141.1 GB" in out


def test_tensor_parallel_and_fsdp_training_terms_count_the_real_modules(tiny):
    """Under engine.tensor_parallel the trainer holds, beside its shard, a partial target (whole
    embedding, norm, lm_head and the layers the head's init copies); under FSDP 1/ranks of the head's
    state, the whole head gathered for the micro-batch (bf16 on GPUs) and its whole gradient."""
    from headstart.heads import init_copied_layers

    cfg = json.loads((tiny / "config.json").read_text())
    recipe = recipe_from_dict({"target": {"model": str(tiny), "dtype": "fp32"}, "engine": {"tensor_parallel": 2},
                               "head": {"type": "mtp", "init_from_target": True},
                               "trainer": {"devices": 4, "strategy": "fsdp"}})
    train = next(p for p in make_plan(recipe, cfg).phases if p.name == "train")
    terms = {t.name: t.bytes for t in train.terms}
    partial = load_llama(tiny, "fp32", layers=init_copied_layers(recipe.head))
    held = sum(p.numel() for n, p in partial.named_parameters() if not n.endswith("bias"))
    assert partial.partial and init_copied_layers(recipe.head) == [-1]
    assert terms["embedding + lm_head (whole)"] == 4 * held
    head = build_head(HeadConfig(head_type="mtp"), load_llama(tiny, "fp32"))
    n = sum(p.numel() for p in head.trainable_parameters())
    assert terms["head weights + grads + AdamW"] == 16 * n / 4 + (2 + 2 + 4) * n
    assert terms["target weights"] == 4 * target_params(partial.config, 2)[0]
    val = {t.name: t.bytes for t in next(p for p in make_plan(recipe, cfg).phases if p.name == "validation").terms}
    # validation runs inside training: the head's state and the partial target stay beside the replica
    assert val["gathered head"] == 4 * n
    assert val["head weights + grads + AdamW"] == terms["head weights + grads + AdamW"]
    assert val["embedding + lm_head (whole)"] == 4 * held


def test_a_recipe_that_would_not_fit_is_refused_by_its_largest_term():
    raw = {"target": {"model": "x"}, "data": {"max_length": 4096},
           "train": {"batch_tokens": 65536, "ttt_steps": 7}, "head": {"type": "eagle3"}}
    cfg = json.loads((ROOT / "recipes" / "targets" / "llama-3.1-8b.json").read_text())
    plan = make_plan(recipe_from_dict(raw), cfg)
    (refusal,) = plan.refusals()
    assert refusal.startswith("train: needs") and "'head activations'" in refusal
    ttt = next(t for t in plan.phases[1].terms if t.name == "TTT attention masks")
    # a bf16 mask per step and bucket length (their squares under 4/3 of the longest's), no (H, n, n) scores
    assert ttt.bytes == 4096 * 4096 * (2 + 3 + 4 + 5 + 6 + 7) * 2 * 4 / 3
    raw["train"]["batch_tokens"] = 8192
    assert make_plan(recipe_from_dict(raw), cfg).refusals() == []


def test_train_and_precompute_refuse_before_loading(tiny, tmp_path, capsys):
    """On this CPU the device is the machine's RAM: a recipe whose activations exceed it is refused by
    name, before the target loads or any output is written (no TTT mask term on CPU: its merged steps
    take none)."""
    text = (f"output_dir: {tmp_path / 'run'}\ntarget:\n  model: {tiny}\n  dtype: fp32\n"
            "data:\n  source: sharegpt\n  max_length: 400000\n"
            "train:\n  source: online\n  batch_tokens: 4000000\n  ttt_steps: 3\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(PlanError, match="'head activations'"):
        check_fits(load_recipe(recipe), json.loads((tiny / "config.json").read_text()), torch.device("cpu"),
                   ("train",), "config.json")
    assert main(["train", str(recipe)]) == 2
    assert "'head activations'" in capsys.readouterr().err
    recipe.write_text(text + "precompute:\n  batch_tokens: 20000000\n")
    assert main(["precompute", str(recipe)]) == 2
    assert "precompute: needs" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written: no output directory, no lock


@pytest.mark.parametrize("devices", ["1", "12"])
def test_tensor_parallelism_the_ranks_cannot_hold_is_refused_by_every_verb(devices, tiny, tmp_path, capsys,
                                                                         monkeypatch):
    """The 70B recipe (tensor_parallel 8) on 1 or 12 training ranks: plan refused to print "fits" for a
    rank holding 1/8 of the target with no group around it; train, precompute and eval, launched without
    the ranks, refuse too, each naming both numbers."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rc = main(["plan", str(ROOT / "recipes" / "llama-3.3-70b-eagle3-8xh100.yaml"), "--target-config",
               str(ROOT / "recipes" / "targets" / "llama-3.3-70b.json"), "--set", f"trainer.devices={devices}",
               "--set", "trainer.num_nodes=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "engine.tensor_parallel 8 does not divide" in err and f"= {devices}" in err, err
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\ntarget:\n  model: {tiny}\n  dtype: fp32\n"
                      "data:\n  source: sharegpt\nengine:\n  tensor_parallel: 2\n")
    assert main(["train", str(recipe), "--set", "trainer.devices=1"]) == 2
    assert "engine.tensor_parallel 2 does not divide" in capsys.readouterr().err
    from headstart.heads import save_head

    save_head(build_head(HeadConfig(head_type="mtp"), load_llama(tiny, "fp32")), tmp_path / "head")
    for verb in (["precompute", str(recipe)], ["eval", str(recipe), "--head", str(tmp_path / "head")]):
        assert main(verb) == 2, verb
        err = capsys.readouterr().err
        assert "tensor-parallel size 2 does not divide the 1 launched ranks" in err, (verb, err)
    assert not (tmp_path / "run").exists()


def test_a_size_the_target_cannot_split_is_refused(tiny):
    recipe = recipe_from_dict({"engine": {"tensor_parallel": 3}})
    with pytest.raises(PlanError, match="num_attention_heads \\(4\\) .* not divisible"):
        make_plan(recipe, json.loads((tiny / "config.json").read_text()))


def test_a_deepseek_plan_counts_the_latent_cache_and_the_active_experts(capsys):
    """DeepSeek-V2-Lite: 15.71 B parameters held, 2.66 B multiplied per token (6 of 64 routed experts);
    the KV pages hold one 576-value latent row per token and layer (27 x 576 x 2 B = 31 KB/token)."""
    rc = main(["plan", str(ROOT / "recipes" / "deepseek-v2-lite-mtp-8xh100.yaml"), "--target-config",
               str(ROOT / "recipes" / "targets" / "deepseek-v2-lite.json"), "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["refusals"] == []
    val = next(p for p in plan["phases"] if p["name"] == "validation")
    kv = next(t for t in val["terms"] if t["name"] == "KV pages")
    # 64 prompts of up to 4,096 tokens: at most sqrt(64 x 16,384 x 4,096) = 65,536 prompt tokens at once, each
    # + 256 new tokens, k + 1 = 4 lookahead and two 16-token pages of rounding, + 8 spare pages; per token the
    # target's 27 latent rows and the MTP layer's own cache (one layer, the same latent width)
    assert kv["bytes"] == (65_536 + 64 * (256 + 4 + 32) + 128) * (27 + 1) * 576 * 2
    assert any("2.66 B FLOP/token, the experts a token is routed to" in a for a in plan["assumptions"])
    with pytest.raises(PlanError, match="DeepSeek targets run unsharded"):
        make_plan(recipe_from_dict({"engine": {"tensor_parallel": 2}}),
                  json.loads((ROOT / "recipes" / "targets" / "deepseek-v2-lite.json").read_text()))


def test_a_target_quantised_in_a_way_no_verb_loads_is_not_planned_as_fitting(tiny):
    """AWQ / GPTQ checkpoints: every loading verb refuses them, so plan must too (not "fits: every phase")."""
    cfg = json.loads((tiny / "config.json").read_text())
    recipe = recipe_from_dict({"target": {"model": str(tiny), "dtype": "fp32"}, "head": {"type": "mtp"}})
    for quant, named in (({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
                         ({"quant_method": "fp8"}, "weight_block_size must be two positive integers")):
        with pytest.raises(PlanError, match=named):
            make_plan(recipe, {**cfg, "quantization_config": quant})
    assert make_plan(recipe, {**cfg, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})


def test_a_loss_chunk_larger_than_the_micro_batch_is_counted_as_the_micro_batch(tiny):
    cfg = json.loads((tiny / "config.json").read_text())

    def loss_bytes(chunk):
        recipe = recipe_from_dict({"target": {"model": str(tiny), "dtype": "fp32"}, "head": {"type": "mtp"},
                                   "train": {"batch_tokens": 512, "loss_chunk_tokens": chunk}})
        train = next(p for p in make_plan(recipe, cfg).phases if p.name == "train")
        return next(t.bytes for t in train.terms if t.name == "chunked loss")

    assert loss_bytes(10**6) == loss_bytes(512) > loss_bytes(256)


def test_the_fused_loss_term_counts_the_gradients_its_objective_keeps(tiny):
    """train.losses.FusedChunks keeps, per TTT step, one lm_head-sized and one batch-sized gradient for each term the
    objective differentiates (sizing.grad_components): kl and lk_alpha one, lk_lambda two (KL and a)."""
    cfg = json.loads((tiny / "config.json").read_text())

    def fused_bytes(loss):
        recipe = recipe_from_dict({"target": {"model": str(tiny), "dtype": "fp32"}, "trainer": {"accelerator": "cpu"},
                                   "head": {"type": "eagle3", "aux_layer_ids": [1, 2], "draft_vocab_size": 64},
                                   "train": {"loss": loss}})
        train = next(p for p in make_plan(recipe, cfg).phases if p.name == "train")
        return next(t.bytes for t in train.terms if t.name == "fused loss gradients")

    one = fused_bytes("kl")
    assert one > 0 and fused_bytes("lk_alpha") == one and fused_bytes("lk_lambda") == fused_bytes("lk") == 2 * one


def test_validation_kv_bounds_every_mix_of_prompt_lengths_the_engine_runs_together():
    """plan's validation KV term bounds the prompts validate.engine_acceptance holds at once (prompts_at_once of
    them, sized for the longest: scheduler.kv_pages_for) for any lengths under max_length, and it is exact when
    every prompt fits one step."""
    import random

    from headstart.inference.scheduler import MEASURED_PREFILL_CAP, prompts_at_once
    from headstart.sizing import engine_kv_tokens

    # 12,800 <= the cap: all at once; each + 128 new tokens, lookahead 4 and two pages of rounding, + 8 spare pages
    assert engine_kv_tokens(32, 400, 128, 4)[0] == 32 * (400 + 128 + 4 + 32) + 128
    rng = random.Random(0)
    for n, length in [(64, 4096), (64, 1024), (8, 8192), (200, 2048)]:
        bound = engine_kv_tokens(n, length, 0, 0)[0] - n * 32 - 128  # the prompt tokens held at once
        assert MEASURED_PREFILL_CAP < bound < n * length
        worst = 0
        for trial in range(400):
            long = rng.randint(1, n)
            lens = [rng.randint(length // 2, length) for _ in range(long)]
            lens += [rng.randint(1, max(1, length // (1 + trial % 50))) for _ in range(n - long)]
            batch = prompts_at_once([[0] * x for x in lens])
            worst = max(worst, sum(sorted(lens, reverse=True)[:batch]))
        assert worst <= bound
        assert worst > bound / 2  # and not loose: these mixes reach 83-93 % of it


@pytest.mark.parametrize(("head", "length"), [({"type": "eagle3", "k": 3}, 190), ({"type": "eagle3", "k": 3}, 400),
                                              ({"type": "mtp", "k": 2}, 190), ({"type": "medusa", "k": 3}, 190),
                                              ({"type": "dflash", "k": 3, "block_size": 16}, 190),
                                              ({"type": "dflash", "k": 3}, 190)])
def test_engine_kv_terms_hold_every_page_the_measuring_engines_allocate(tiny, head, length):
    """plan's validation and eval KV terms, per-sequence slack and the draft's own cache included, against the pages
    validate.engine_acceptance and evaluate._engine give their engines (scheduler.kv_pages_for: each sequence in
    whole pages plus one, its lookahead, 8 spare pages; as many pages again for the head's cache) for mixes of
    prompt lengths under max_length, the all-longest mix included; 400 x 64 prompts exceed the prefill cap."""
    import random

    from headstart.inference.kv_cache import KVCacheSpec
    from headstart.inference.proposers import draft_kv_spec
    from headstart.inference.scheduler import kv_pages_for, prompts_at_once
    from headstart.inference.speculation import SpecConfig, spec_method
    from headstart.sizing import EVAL_BATCH

    cfg = json.loads((tiny / "config.json").read_text())
    new, n = 100, 64
    recipe = recipe_from_dict({"target": {"model": str(tiny), "dtype": "fp32"}, "head": head,
                               "data": {"max_length": length}, "train": {"val_prompts": n, "val_max_tokens": new}})
    plan = {p.name: next(t.bytes for t in p.terms if t.name == "KV pages") for p in make_plan(recipe, cfg).phases
            if p.name in ("validation", "eval")}
    target = load_llama(tiny, "fp32")
    drafter = build_head(HeadConfig(head_type=head["type"], block_size=head.get("block_size"), draft_vocab_size=None),
                         target)
    per_token = sum(spec.bytes_per_page(1) for spec in (KVCacheSpec.of(target), draft_kv_spec(drafter)) if spec)
    assert per_token > KVCacheSpec.of(target).bytes_per_page(1) or head["type"] == "medusa"
    lookahead = SpecConfig(method=spec_method(head["type"]), k=head["k"], head=drafter).lookahead
    rng = random.Random(0)
    for trial in range(200):
        lens = [length - 1] * n if trial == 0 else [rng.randint(1, length - 1) for _ in range(n)]
        prompts = [[0] * x for x in lens]
        pages = kv_pages_for(prompts, new, prompts_at_once(prompts), lookahead, 16, cfg["max_position_embeddings"])
        assert pages * 16 * per_token <= plan["validation"], (trial, pages * 16, plan["validation"] / per_token)
        pages = kv_pages_for(prompts, new, EVAL_BATCH, lookahead, 16, cfg["max_position_embeddings"])
        assert pages * 16 * per_token <= plan["eval"], (trial, pages * 16, plan["eval"] / per_token)
