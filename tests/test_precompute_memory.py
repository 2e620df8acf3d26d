"""Precompute's memory, measured: every byte the CPU allocator hands out while a shard is computed and
written (torch's profiler records each allocation and free), against `headstart plan`'s precompute phase.
The plan must be at least the measured peak for an MLP-bound and an attention-bound target, with and without
aux states, fp32 and bf16, fp8 storage; its GPU terms are the same formulas (benchmarks/gpu_check.md)."""

import json

import pytest
from conftest import make_tokenizer, random_conversations, write_jsonl
from tiny_models import make_hf_model

from headstart.plan import make_plan
from headstart.precompute import run_precompute
from headstart.precompute.run import SHARD_LABEL
from headstart.recipe_io import load_recipe


def peak_bytes_in(fn, label: str) -> tuple[int, int]:
    """(live bytes when the first `label` range opens, their peak inside it) while fn runs, counted from
    fn's start: what was allocated before (the weights, the KV pages) and is still held counts."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == label]
    assert spans, f"no {label!r} range was recorded"
    lo, hi = spans[0]
    live, before, peak = 0, None, 0
    for e in events:
        if e.name() != "[memory]":
            continue
        if before is None and e.start_ns() >= lo:
            before = live
        live += e.nbytes()
        if lo <= e.start_ns() <= hi:
            peak = max(peak, live)
    return before, peak


@pytest.mark.parametrize("family,intermediate,aux,dtype,storage", [
    ("llama", 512, None, "fp32", "bf16"),  # MLP-bound: the fused gate/up output and the activated product
    ("llama", 512, None, "bf16", "bf16"),
    ("llama", 512, [1, 2, 3], "bf16", "fp8"),
    ("llama", 64, [1, 2, 3], "bf16", "fp8"),  # attention-bound, then the fp8 quantisation of the aux states
    ("llama", 64, None, "fp32", "bf16"),
    ("deepseek-v3", 96, None, "bf16", "fp8"),  # MLA + routed experts
    ("deepseek-v3", 384, None, "fp32", "bf16"),
    ("deepseek-v3-moe", 32, None, "bf16", "bf16"),  # routed experts: 4 per token, 4 x 128 wide
])
def test_the_plan_bounds_what_precompute_allocates(tmp_path, family, intermediate, aux, dtype, storage):
    tok = make_tokenizer("chatml")
    model = tmp_path / "model"
    if family == "llama":
        make_hf_model("llama", model, seed=2, vocab_size=len(tok), intermediate_size=intermediate,
                      num_hidden_layers=4)
    else:
        from test_deepseek import CONFIGS, _hf_model

        kind, overrides = CONFIGS["v3"]
        overrides = {**overrides, "vocab_size": len(tok), "intermediate_size": intermediate}
        if family.endswith("moe"):
            overrides.update(num_attention_heads=1, num_key_value_heads=1, num_experts_per_tok=4,
                             moe_intermediate_size=128)
        _hf_model(kind, overrides).save_pretrained(model)
    tok.save_pretrained(model)
    data = write_jsonl(tmp_path / "chats.jsonl", random_conversations(200, 0))
    head = f"  type: {'mtp' if family == 'llama' else 'deepseek_mtp'}\n" if aux is None else \
        f"  type: eagle3\n  aux_layer_ids: {aux}\n"
    (tmp_path / "r.yaml").write_text(
        f"output_dir: {tmp_path / 'out'}\ntarget:\n  model: {model}\n  dtype: {dtype}\n"
        f"data:\n  source: {data}\n  max_length: 256\n  heldout_fraction: 0.1\nhead:\n{head}"
        f"precompute:\n  shard_tokens: 100000\n  batch_tokens: 2048\n  storage: {storage}\n")
    recipe = load_recipe(tmp_path / "r.yaml")
    before, peak = peak_bytes_in(lambda: run_precompute(recipe, progress=False), SHARD_LABEL)
    plan = make_plan(recipe, json.loads((model / "config.json").read_text()), device="CPU RAM",
                     phases=("precompute",))
    phase = plan.phases[0]
    terms = {t.name: t.bytes for t in phase.terms}
    print(f"{family} I={intermediate} aux={aux} {dtype} {storage}: measured {peak / 1e6:.2f} MB, plan "
          f"{phase.total / 1e6:.2f} MB ({terms['target activations'] / 1e6:.2f} MB activations: "
          f"{phase.terms[1].note})")
    # the weights and the KV pages are allocated before the shard, as planned (+ rope tables, the tokenizer)
    assert terms["target weights"] + terms["KV pages"] <= before <= 1.1 * (terms["target weights"] + terms["KV pages"])
    assert peak <= phase.total, (f"precompute allocated {peak / 1e6:.2f} MB, the plan says {phase.total / 1e6:.2f} "
                                 f"MB: {[(t.name, round(t.bytes / 1e6, 2)) for t in phase.terms]}")
    # and the plan is not a blanket over-estimate: the layer's transient is most of it
    assert peak >= 0.6 * phase.total
