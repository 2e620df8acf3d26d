"""Tensor parallelism in the engine (headstart.nn.parallel): 2 ranks launched with torchrun over gloo on
this CPU against the same model on 1 rank. The residual stream and logits are whole on every rank; the
row-parallel sums run in a different order than one rank's matmul, so hidden states and logits agree
within a stated tolerance (fp32: 2e-5 absolute + relative) and greedy tokens, plain and speculative,
agree exactly. Each case also checks the shard a rank holds (its q / KV heads) and that it never read
the whole model (the weights' fingerprint is the whole checkpoint's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model

from headstart.errors import AssetError
from headstart.heads import HeadConfig, build_head, build_vocab_maps, save_head
from headstart.models.llama import load_llama
from headstart.nn.parallel import TensorParallel

WORKER = Path(__file__).with_name("tp_worker.py")
TOL = {"atol": 2e-5, "rtol": 2e-5}

CASES = {  # name: (family, vocab, config overrides, head family, draft vocabulary)
    # KV heads split 1 + 1, q/k/v/o and MLP biases (row-parallel ones held by rank 0), an mtp head over
    # a 64-token draft vocabulary (restricted lm_head rows gathered from both ranks)
    "llama-kv-split": ("llama-bias", 320, {}, "mtp", 64),
    # qkv bias, a vocabulary of 321 (the last rank's rows padded), an eagle3 head fusing aux layers
    "qwen2-vocab-pad": ("qwen2", 321, {}, "eagle3", None),
    # one KV head replicated on both ranks, tied embeddings, full-vocabulary mtp head
    "llama-tied-kv-replicated": ("llama-tied", 320, {"num_key_value_heads": 1}, "mtp", None),
}


def _run(args: list[str], tp: int, timeout: int = 600) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(WORKER.parent), str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"] if tp > 1 \
        else [sys.executable]
    out = subprocess.run([*launch, str(WORKER), *args, "--tp", str(tp)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"tp={tp} worker failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, vocab, overrides, head_family, vd = CASES[request.param]
    d = tmp_path_factory.mktemp(f"tp-{request.param}")
    make_hf_model(family, d / "model", seed=11, vocab_size=vocab, **overrides)
    target = load_llama(d / "model", "fp32")
    torch.manual_seed(0)
    head = build_head(HeadConfig(head_type=head_family, draft_vocab_size=vd,
                                 aux_layer_ids=[0, 1, 2] if head_family == "eagle3" else None), target)
    if vd:
        counts = torch.rand(vocab, dtype=torch.float64)
        head.set_vocab_maps(*build_vocab_maps(counts, vd))
    with torch.no_grad():  # a head that drafts something other than the copied target's guesses
        for p in head.trainable_parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_head(head, d / "head")
    results = {}
    for tp in (1, 2):
        _run([str(d / "model"), str(d / f"tp{tp}.pt"), "--head", str(d / "head")], tp)
        results[tp] = torch.load(d / f"tp{tp}.pt", weights_only=False)
    return request.param, results


def test_two_ranks_compute_what_one_rank_computes(case):
    name, r = case
    one, two = r[1], r[2]
    family, vocab, overrides, _, _ = CASES[name]
    kv = overrides.get("num_key_value_heads", 2)
    assert (one["size"], two["size"]) == (1, 2)
    assert (two["local_heads"], two["local_kv_heads"]) == (2, max(1, kv // 2))
    assert (one["local_heads"], one["local_kv_heads"]) == (4, kv)
    assert two["fingerprint"] == one["fingerprint"]
    torch.testing.assert_close(two["hidden"], one["hidden"], **TOL)
    for j in one["aux"]:
        torch.testing.assert_close(two["aux"][j], one["aux"][j], **TOL)
    assert two["logits"].shape == one["logits"].shape == (one["hidden"].shape[0], vocab)
    torch.testing.assert_close(two["logits"], one["logits"], **TOL)
    assert two["plain"] == one["plain"]
    if "restricted" in one:  # the draft vocabulary's rows, gathered from the rank holding each: exact
        assert torch.equal(two["restricted"], one["restricted"])


def test_speculation_under_tensor_parallelism_stays_lossless(case):
    name, r = case
    one, two = r[1], r[2]
    assert two["spec"] == two["plain"] == one["plain"]
    assert one["spec"] == one["plain"]
    assert two["spec_metrics"]["steps"] > 0
    assert two["spec_metrics"]["tau"] == pytest.approx(one["spec_metrics"]["tau"])
    assert two["spec_metrics"]["accept_histogram"] == one["spec_metrics"]["accept_histogram"]
    # sampled drafts and the full-q rule: the same seeded draws on both (logits agree to ~1e-6)
    assert two["sampled"] == one["sampled"]
    assert all(len(t) == 10 for t in two["sampled"])


def test_shapes_the_tensor_parallel_size_cannot_split_are_refused(tmp_path):
    make_hf_model("llama", tmp_path / "m", seed=1)  # 4 q heads, 2 KV heads, intermediate 112
    with pytest.raises(AssetError, match="num_attention_heads \\(4\\) is not divisible by the tensor-parallel size 3"):
        load_llama(tmp_path / "m", "fp32", tp=TensorParallel(0, 3))
    # 8 ranks: 4 q heads cannot be split 8 ways
    with pytest.raises(AssetError, match="not divisible by the tensor-parallel size 8"):
        load_llama(tmp_path / "m", "fp32", tp=TensorParallel(1, 8))
    with pytest.raises(ValueError, match="not a valid place"):
        TensorParallel(2, 2)


def test_kv_heads_replicated_over_more_ranks_follow_their_q_heads(tmp_path):
    """8 q heads, 2 KV heads, 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1 (each rank's two
    q heads are in one KV group); the layout of ranks in groups is consecutive."""
    from headstart.nn.parallel import tp_groups, tp_layout

    assert [TensorParallel(r, 4).kv_heads(8, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [TensorParallel(r, 2).kv_heads(8, 2) for r in range(2)] == [(0, 1), (1, 1)]
    make_hf_model("llama", tmp_path / "m", seed=2, num_attention_heads=8, num_key_value_heads=2)
    whole = load_llama(tmp_path / "m", "fp32")
    dh = whole.config.head_dim
    q, kv = 8 * dh, 2 * dh
    for r in range(4):
        part = load_llama(tmp_path / "m", "fp32", tp=TensorParallel(r, 4))
        w, p = whole.model.layers[1].self_attn.qkv_proj.weight, part.model.layers[1].self_attn.qkv_proj.weight
        assert p.shape[0] == 2 * dh + 2 * dh
        torch.testing.assert_close(p[: 2 * dh], w[r * 2 * dh:(r + 1) * 2 * dh], rtol=0, atol=0)
        g = r // 2  # the KV head of this rank's q heads
        torch.testing.assert_close(p[2 * dh: 3 * dh], w[q + g * dh: q + (g + 1) * dh], rtol=0, atol=0)
        torch.testing.assert_close(p[3 * dh:], w[q + kv + g * dh: q + kv + (g + 1) * dh], rtol=0, atol=0)
    # 8 processes as 2 data-parallel copies of a 4-rank model: ranks 0-3 and 4-7
    assert tp_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [tp_layout(r, 8, 4) for r in (0, 3, 4, 7)] == [(0, 0, 0, 2), (3, 0, 0, 2), (0, 1, 1, 2), (3, 1, 1, 2)]
    with pytest.raises(ValueError, match="no place"):
        tp_layout(3, 6, 4)


def test_a_rank_reads_only_its_shard(tmp_path):
    """In-process: rank 1 of 2 holds the second half of every split tensor (no collective runs)."""
    make_hf_model("qwen2", tmp_path / "m", seed=3, vocab_size=321)
    whole = load_llama(tmp_path / "m", "fp32")
    part = load_llama(tmp_path / "m", "fp32", tp=TensorParallel(1, 2))
    c, dh = whole.config, whole.config.head_dim
    wq = whole.model.layers[0].self_attn.qkv_proj.weight
    pq = part.model.layers[0].self_attn.qkv_proj.weight
    q, kv = c.num_attention_heads * dh, c.num_key_value_heads * dh
    torch.testing.assert_close(pq[: q // 2], wq[q // 2: q], rtol=0, atol=0)  # q heads 2, 3
    torch.testing.assert_close(pq[q // 2: q // 2 + kv // 2], wq[q + kv // 2: q + kv], rtol=0, atol=0)  # KV head 1
    wb, pb = whole.model.layers[0].mlp.down_proj, part.model.layers[0].mlp.down_proj
    torch.testing.assert_close(pb.weight, wb.weight[:, c.intermediate_size // 2:], rtol=0, atol=0)
    emb = part.model.embed_tokens.weight  # rows 161..320 and one row of padding
    assert emb.shape == (161, c.hidden_size)
    torch.testing.assert_close(emb[:160], whole.model.embed_tokens.weight[161:], rtol=0, atol=0)
    assert not emb[160].any()
    torch.testing.assert_close(part.lm_head.weight[:160], whole.lm_head.weight[161:], rtol=0, atol=0)


def test_precompute_on_two_tensor_parallel_ranks_stores_what_one_rank_stores(tmp_path, chat_model_dir):
    """`torchrun --nproc-per-node 2 -m headstart.cli precompute RECIPE --set engine.tensor_parallel=2`: one
    model copy over two ranks; its rank 0 writes the shards. Same sequences, ids and masks; the hidden
    states (stored in bf16) within one bf16 rounding of the 1-rank run's."""
    from conftest import random_conversations, write_jsonl
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "d.jsonl", random_conversations(24, seed=5))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\ntarget:\n  model: {chat_model_dir}\n  dtype: fp32\n"
                      f"data:\n  source: {data}\n  max_length: 96\n  heldout_fraction: 0.1\n"
                      "head:\n  type: eagle3\n  aux_layer_ids: [0, 1, 2]\n"
                      "precompute:\n  shard_tokens: 400\n  batch_tokens: 256\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]
    runs = {}
    for tp in (1, 2):
        out = tmp_path / f"pc{tp}"
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"] \
            if tp > 1 else [sys.executable]
        done = subprocess.run([*launch, "-m", "headstart.cli", "precompute", str(recipe), "--set",
                               f"engine.tensor_parallel={tp}", "--set", f"precompute.output_dir={out}"],
                              env=env, cwd=root, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        runs[tp] = sorted(out.glob("shard-*.safetensors"))
    assert len(runs[1]) == len(runs[2]) > 1
    for a, b in zip(runs[1], runs[2]):
        x, y = load_file(a), load_file(b)
        assert x.keys() == y.keys()
        for key in ("input_ids", "loss_mask", "seq_offsets"):
            assert torch.equal(x[key], y[key])
        for key in ("hidden", "aux_hidden"):
            torch.testing.assert_close(y[key].float(), x[key].float(), atol=1e-2, rtol=1 / 128)


def test_eval_on_two_tensor_parallel_ranks_reports_what_one_rank_reports(tmp_path, chat_model_dir):
    """`torchrun --nproc-per-node 2 -m headstart.cli eval RECIPE --tp 2 ...`: rank 0 writes the report;
    acceptance and the lossless check equal the 1-rank eval's. Two processes without --tp are refused
    (eval runs one model copy)."""
    import json

    from conftest import write_jsonl

    torch.manual_seed(0)
    head = build_head(HeadConfig(head_type="mtp"), load_llama(chat_model_dir, "fp32"))
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_head(head, tmp_path / "head")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"tell me about {w} and {v}"}
                                                 for w, v in (("cats", "dogs"), ("rain", "sun"), ("a", "b"))])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'out'}\ntarget:\n  model: {chat_model_dir}\n  dtype: fp32\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]

    def run(procs, *extra):
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"] \
            if procs > 1 else [sys.executable]
        return subprocess.run([*launch, "-m", "headstart.cli", "eval", str(recipe), "--head", str(tmp_path / "head"),
                               "--prompts", str(prompts), "--k", "1,3", "--max-tokens", "10", "--batch-size", "2",
                               "--no-progress", *extra], env=env, cwd=root, capture_output=True, text=True,
                              timeout=600)

    for tp in (1, 2):
        done = run(tp, "--tp", str(tp), "--out", str(tmp_path / f"rep{tp}"))
        assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rep{tp}" / "report.json").read_text()) for tp in (1, 2)]
    assert reports[1]["settings"]["tensor_parallel"] == 2
    keep = ("head", "method", "k", "temperature", "tau", "accept_histogram", "lossless_check", "steps")
    assert [{k: r.get(k) for k in keep} for r in reports[1]["runs"]] == \
        [{k: r.get(k) for k in keep} for r in reports[0]["runs"]]
    assert all(r["lossless_check"] == "identical" for r in reports[1]["runs"])
    refused = run(2, "--out", str(tmp_path / "rep-refused"))
    assert refused.returncode != 0 and "runs one copy of the target" in refused.stderr
    assert not (tmp_path / "rep-refused").exists()
