"""Precompute's memory, measured: every byte the CPU allocator hands out while a shard is computed and
written (torch's profiler records each allocation and free), against `headstart plan`'s precompute phase.
The plan must be at least the measured peak for an MLP-bound and an attention-bound target, with and without
aux states, fp32 and bf16, fp8 storage; its GPU terms are the same formulas (benchmarks/gpu_check.md)."""

import json

import pytest
import torch
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


@pytest.mark.parametrize("family,intermediate,aux,dtype,storage,batch", [
    ("llama", 512, None, "fp32", "bf16", 2048),  # MLP-bound: the fused gate/up output and the activated product
    ("llama", 512, None, "bf16", "bf16", 2048),
    ("llama", 512, None, "bf16", "bf16", 128),  # sequences up to 256 tokens: one longer than a batch goes alone
    ("llama", 512, [1, 2, 3], "bf16", "fp8", 2048),
    ("llama", 64, [1, 2, 3], "bf16", "fp8", 2048),  # attention-bound, then the fp8 quantisation of the aux states
    ("llama", 64, None, "fp32", "bf16", 2048),
    # torch's attention without the row-invariant kernels (CUDA without FlashInfer), long sequences among many
    # short ones: the keys of each sequence are gathered alone, not padded to the batch's longest
    ("llama-torch-mixed", 64, None, "bf16", "bf16", 2048),
    ("deepseek-v3", 96, None, "bf16", "fp8", 2048),  # MLA + routed experts
    ("deepseek-v3", 384, None, "fp32", "bf16", 2048),
    ("deepseek-v3-moe", 32, None, "bf16", "bf16", 2048),  # routed experts: 4 per token, 4 x 128 wide
    ("deepseek-v3-moe-narrow", 32, None, "bf16", "bf16", 2048),  # 4 x 24 wide, under d: the weighting's copies
])
def test_the_plan_bounds_what_precompute_allocates(tmp_path, monkeypatch, family, intermediate, aux, dtype,
                                                   storage, batch):
    tok = make_tokenizer("chatml")
    model = tmp_path / "model"
    chats = random_conversations(200, 0)
    if family == "llama-torch-mixed":
        monkeypatch.setattr("headstart.inference.backends.rowwise_kernels", lambda: None)
        long = [{**c, "id": f"long{i}"} for i, c in enumerate(random_conversations(8, 1, user_words=(40, 50),
                                                                              reply_words=(40, 50)))]
        short = random_conversations(8 * 150, 2, max_rounds=1, user_words=(1, 1), reply_words=(1, 1))
        chats = [c for i, long_one in enumerate(long) for c in (long_one, *short[150 * i:150 * i + 150])]
    if family.startswith("llama"):
        make_hf_model("llama", model, seed=2, vocab_size=len(tok), intermediate_size=intermediate,
                      num_hidden_layers=4, num_key_value_heads=4 if family.endswith("mixed") else 2)
    else:
        from test_deepseek import CONFIGS, _hf_model

        kind, overrides = CONFIGS["v3"]
        overrides = {**overrides, "vocab_size": len(tok), "intermediate_size": intermediate}
        if "moe" in family:
            overrides.update(num_attention_heads=1, num_key_value_heads=1, num_experts_per_tok=4,
                             moe_intermediate_size=24 if family.endswith("narrow") else 128)
        _hf_model(kind, overrides).save_pretrained(model)
    tok.save_pretrained(model)
    data = write_jsonl(tmp_path / "chats.jsonl", chats)
    head = f"  type: {'mtp' if family.startswith('llama') else 'deepseek_mtp'}\n" if aux is None else \
        f"  type: eagle3\n  aux_layer_ids: {aux}\n"
    (tmp_path / "r.yaml").write_text(
        f"output_dir: {tmp_path / 'out'}\ntarget:\n  model: {model}\n  dtype: {dtype}\n"
        f"data:\n  source: {data}\n  max_length: 256\n  heldout_fraction: 0.1\nhead:\n{head}"
        f"precompute:\n  shard_tokens: 4096\n  batch_tokens: {batch}\n  storage: {storage}\n")
    recipe = load_recipe(tmp_path / "r.yaml")
    # one thread: the CPU attention's per-thread scratch (~100 KB each) is not the device memory planned
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before, peak = peak_bytes_in(lambda: run_precompute(recipe, progress=False), SHARD_LABEL)
    finally:
        torch.set_num_threads(threads)
    plan = make_plan(recipe, json.loads((model / "config.json").read_text()), device="CPU RAM",
                     phases=("precompute",))
    phase = plan.phases[0]
    terms = {t.name: t.bytes for t in phase.terms}
    print(f"{family} I={intermediate} aux={aux} {dtype} {storage}: measured {peak / 1e6:.2f} MB, plan "
          f"{phase.total / 1e6:.2f} MB ({terms['target activations'] / 1e6:.2f} MB activations: "
          f"{phase.terms[1].note})")
    # the weights and the KV pages are allocated before the shard, as planned (+ rope tables, the tokenizer)
    assert terms["target weights"] + terms["KV pages"] <= before <= 1.1 * (terms["target weights"] + terms["KV pages"])
    host = 4096 * (8 + 1)  # the shard's token ids and loss mask, on the host (here the same memory)
    assert peak <= phase.total + host, (
        f"precompute allocated {peak / 1e6:.2f} MB, the plan says {phase.total / 1e6:.2f} MB (+ {host / 1e6:.2f} MB "
        f"on the host): {[(t.name, round(t.bytes / 1e6, 2)) for t in phase.terms]}")
    # and the plan is not a blanket over-estimate: the layer's transient is most of it
    assert peak >= 0.6 * phase.total
