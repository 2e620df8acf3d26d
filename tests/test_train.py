"""Training: losses (chunked, exact gradient, flat memory), the training-time-test unroll against the
engine's draft steps, the data stream (packing, ranks, resume), and `headstart train` end to end on a
tiny random target: outputs, engine validation == the engine on the saved head, shards == online,
SIGKILL + --resume == uninterrupted, 2 gloo processes == 1, non-finite steps, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import random_conversations, write_jsonl

from headstart.cli import main
from headstart.config import load_recipe
from headstart.errors import ConfigError, DataError
from headstart.heads import HeadConfig, PackedBatch, build_head, load_head
from headstart.inference.backends import TorchAttention
from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator
from headstart.inference.scheduler import build_metadata
from headstart.models.llama import load_llama
from headstart.train.data import PackedStream, TokenSequences, pack
from headstart.train.losses import distill, target_logits
from headstart.train.module import target_forward
from headstart.train.ttt import unroll
from headstart.train.validate import engine_acceptance

ROOT = Path(__file__).resolve().parents[1]


def _conversations(n, seed=0):
    return random_conversations(n, seed, max_rounds=2, user_words=(2, 10), reply_words=(4, 24))


def _recipe(tmp_path, model_dir, name="run", n=48, head="mtp", train=None, extra=""):
    data = tmp_path / f"{name}.jsonl"
    if not data.exists():
        write_jsonl(data, _conversations(n))
    tr = {"source": "online", "max_steps": 6, "batch_tokens": 256, "warmup_steps": 1, "val_every_steps": 3,
          "val_prompts": 3, "val_max_tokens": 8, "val_loss_batches": 2, "ckpt_every_steps": 2, **(train or {})}
    tr_lines = "".join(f"  {k}: {v}\n" for k, v in tr.items())
    text = (f"output_dir: {tmp_path / name}\nseed: 3\ntarget:\n  model: {model_dir}\n  dtype: fp32\n"
            f"data:\n  source: {data}\n  max_length: 96\n  heldout_fraction: 0.15\n"
            f"head:\n  type: {head}\n  k: 3\n{extra}"
            f"precompute:\n  shard_tokens: 400\n  batch_tokens: 256\n"
            f"train:\n{tr_lines}trainer:\n  precision: 32-true\nlogging:\n  wandb: false\n  every_steps: 1\n")
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


def _curve(run_dir):
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f)]


def _losses(run_dir):
    return {int(r["step"]): float(r["loss"]) for r in _curve(run_dir) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny_models import make_hf_model

    d = tmp_path_factory.mktemp("target")
    make_hf_model("llama", d, seed=5, vocab_size=512)
    return load_llama(d, "fp32")


def _batch(target, lens=(11, 7, 14), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, target.config.vocab_size, (sum(lens),), generator=g)
    mask = (torch.rand(sum(lens), generator=g) > 0.3).to(torch.uint8)
    return target_forward(target, PackedBatch(ids, list(lens), None, None, mask), [0, 1, 2])


# ------------------------------------------------------------------------------------------ losses


def test_chunked_kl_equals_the_plain_formula_and_its_gradient(target):
    head = build_head(HeadConfig(head_type="mtp"), target)
    b = _batch(target)
    hh = (torch.randn(b.input_ids.numel(), 64) * 2).requires_grad_()
    rows = torch.tensor([0, 3, 4, 9, 10, 20, 30])
    part = distill(head, hh, b.hidden, rows, None, chunk=3)
    part.kl.backward()
    g_chunked = hh.grad.clone()
    hh.grad = None
    logq = torch.log_softmax(head.compute_logits(hh[rows]), -1)
    logp = torch.log_softmax(target_logits(head, b.hidden[rows]), -1)
    plain = (logp.exp() * (logp - logq)).sum()
    plain.backward()
    torch.testing.assert_close(part.kl, plain.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_chunked, hh.grad, rtol=1e-5, atol=1e-6)
    assert part.rows == 7
    top = (logq.argmax(-1) == logp.argmax(-1)).sum()
    assert float(part.correct) == float(top)
    expected = torch.minimum(logp.exp(), logq.exp()).sum().detach()
    assert float(part.accept) == pytest.approx(float(expected), rel=1e-5)


def test_reduced_vocabulary_kl_and_statistics(target):
    """eagle3: KL against p restricted to the draft vocabulary and renormalised; top-1 compares the
    draft argmax mapped to target ids with the target argmax; acceptance uses the unrenormalised p."""
    from headstart.heads import build_vocab_maps

    head = build_head(HeadConfig(head_type="eagle3", aux_layer_ids=[0, 1, 2], draft_vocab_size=96), target)
    d2t, t2d = build_vocab_maps(torch.arange(512, 0, -1).float(), 96)  # ids 0..95 most frequent... then shifted
    d2t = d2t + 7 * (torch.arange(96) >= 40)  # a non-trivial map: draft ids 40.. point 7 further
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[torch.arange(96) + d2t] = True
    head.set_vocab_maps(d2t, t2d)
    b = _batch(target)
    hh = torch.randn(b.input_ids.numel(), 64)
    rows = torch.arange(0, 30, 2)
    part = distill(head, hh, b.hidden, rows, None, chunk=4)
    ids = torch.arange(96) + d2t
    logq = torch.log_softmax(head.compute_logits(hh[rows]), -1)
    p_full = torch.softmax(target_logits(head, b.hidden[rows]), -1)
    p = p_full[:, ids] / p_full[:, ids].sum(-1, keepdim=True)
    torch.testing.assert_close(part.kl, (p * (p.log() - logq)).sum(), rtol=1e-5, atol=1e-5)
    assert float(part.correct) == float((ids[logq.argmax(-1)] == p_full.argmax(-1)).sum())
    assert float(part.accept) == pytest.approx(float(torch.minimum(p_full[:, ids], logq.exp()).sum()), rel=1e-5)


def _plain_kl(head, hh, th):
    logq = torch.log_softmax(head.compute_logits(hh), -1)
    logp = torch.log_softmax(target_logits(head, th), -1)
    return (logp.exp() * (logp - logq)).sum()


def test_module_loss_is_the_documented_weighted_sum(target):
    """mtp with 3 unrolled steps: sum_j decay^j (KL_j / n_j + w_f * smoothL1_j / (n_j d)), over the
    supervised rows valid at step j, against the target's next row; medusa: head j against row i+1+j."""
    import torch.nn.functional as F

    from headstart.config import recipe_from_dict
    from headstart.train.module import HeadModule

    recipe = recipe_from_dict({"train": {"ttt_steps": 3, "ttt_decay": 0.7, "loss_weights": {"kl": 1.0,
                                                                                            "feature": 0.5}}})
    head = build_head(HeadConfig(head_type="mtp"), target)
    module = HeadModule(recipe, target, head)
    b = _batch(target)
    with torch.no_grad():
        loss, stats = module.losses(b)
        outs, valid, sh = unroll(head, b, 3)
        th = b.hidden[sh.target_rows]
        expected = 0.0
        for j in range(3):
            rows = torch.nonzero((sh.token_mask > 0) & valid[j]).flatten()
            n = rows.numel()
            scale = th[rows].pow(2).mean(-1, keepdim=True).sqrt()
            feat = F.smooth_l1_loss(outs[j][rows] / scale, th[rows] / scale, reduction="sum")
            expected += 0.7 ** j * (_plain_kl(head, outs[j][rows], th[rows]) / n + 0.5 * feat / (n * 64))
            assert stats["rows"][j] == n
    torch.testing.assert_close(loss, torch.as_tensor(expected, dtype=loss.dtype), rtol=1e-5, atol=1e-5)
    med = build_head(HeadConfig(head_type="medusa", medusa_num_heads=2), target)
    module = HeadModule(recipe, target, med)
    with torch.no_grad():
        loss, _ = module.losses(b)
        states = med.forward_heads(med.target_features(b.hidden))
        lens, ends, expected = [11, 7, 14], [11, 18, 32], 0.0
        seq_end = torch.tensor([e for n, e in zip(lens, ends) for _ in range(n)])
        for j in range(2):
            i = torch.arange(32)
            ok = (i + 2 + j < seq_end) & (b.loss_mask[(i + 2 + j).clamp(max=31)] > 0)
            rows = i[ok]
            expected += _plain_kl(med, states[rows, j], b.hidden[rows + 1 + j]) / rows.numel()
    torch.testing.assert_close(loss, torch.as_tensor(expected, dtype=loss.dtype), rtol=1e-5, atol=1e-5)


def test_no_tokens_by_vocab_tensor_is_kept_for_backward(target):
    """Saved activations grow with tokens x width, never tokens x vocab: the logits of a chunk are
    recomputed in the backward pass."""
    head = build_head(HeadConfig(head_type="mtp"), target)
    vocab = target.config.vocab_size

    def saved_bytes(n):
        g = torch.Generator().manual_seed(1)
        h = torch.randn(n, 64, generator=g)
        hh = torch.randn(n, 64, generator=g).requires_grad_()
        sizes = []

        def pack_hook(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            part = distill(head, hh, h, torch.arange(n), None, chunk=16)
        part.kl.backward()
        return sum(sizes), max(sizes)

    small_total, small_max = saved_bytes(64)
    big_total, big_max = saved_bytes(512)
    assert big_max < 16 * vocab * 4  # nothing as large as one chunk's logits is saved
    assert big_total < 8 * small_total * 1.2  # linear in tokens (with a tokens x vocab tensor: ~ 8x vocab/width more)
    assert big_total < 3 * 512 * 64 * 4  # a few copies of the (tokens, width) input; a [tokens x vocab] is 8x that


# ------------------------------------------------------------------------------ TTT == draft steps


@pytest.mark.parametrize("kind", ["mtp", "eagle1", "deepseek_mtp", "eagle3"])
def test_unrolled_step_j_is_the_engine_draft_step_j(target, kind):
    """Absorb positions 0..m with the target's states through the paged cache, then draft steps
    j = 1..3 one row each (own output fed back, ground-truth tokens): step j of the unroll at row
    m + j computes the same hidden state."""
    kw = {"aux_layer_ids": [0, 1, 2]} if kind == "eagle3" else {}
    head = build_head(HeadConfig(head_type=kind, **kw), target).eval()
    b = _batch(target, lens=(7, 16, 5))  # checked in the middle sequence: its neighbours must not leak in
    steps = 4
    with torch.no_grad():
        outs, valid, sh = unroll(head, b, steps)
    first = 6  # the middle sequence's shifted rows start after the first one's 7 - 1
    feats = head.target_features(b.hidden[sh.src_rows], b.aux_hidden[sh.src_rows] if kind == "eagle3" else None)
    feats, tokens = feats[first:first + 15], sh.tokens[first:first + 15]
    outs = [o[first:first + 15] for o in outs]
    cfg = head.config
    backend = TorchAttention()
    for m in (4, 9):
        alloc = PageAllocator(32, 4)
        cache = KVCache(KVCacheSpec(num_layers=head.kv_layers(), num_kv_heads=cfg.num_key_value_heads,
                                    head_dim=cfg.head_dim, dtype=torch.float32), 32, 4, "cpu")
        alloc.reserve("s", m + steps + 1)
        with torch.no_grad():
            meta = build_metadata(alloc, [("s", 0, m + 1)], torch.device("cpu"))
            h, _ = head.draft_step(tokens[:m + 1], feats[:m + 1], meta, cache.layers, backend)
            own = h[-1:]
            torch.testing.assert_close(h[-1], outs[0][m], rtol=1e-4, atol=1e-4)
            for j in range(1, steps):
                meta = build_metadata(alloc, [("s", m + j, m + j + 1)], torch.device("cpu"))
                own, _ = head.draft_step(tokens[m + j:m + j + 1], own, meta, cache.layers, backend)
                torch.testing.assert_close(own[0], outs[j][m + j], rtol=1e-4, atol=1e-4)
    assert valid[2].tolist() == [p >= 2 for p in range(6)] + [p >= 2 for p in range(15)] + [p >= 2 for p in range(4)]


def test_one_unrolled_step_is_train_forward(target):
    head = build_head(HeadConfig(head_type="mtp"), target)
    b = _batch(target)
    with torch.no_grad():
        outs, _, _ = unroll(head, b, 1)
        ref, _ = head.train_forward(b)
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)


def test_medusa_and_draft_lm_keep_the_loss_mask(target):
    ids = torch.tensor([10, 11, 12, 13, 20, 21, 22])
    mask = torch.tensor([0, 1, 1, 0, 0, 0, 1], dtype=torch.uint8)
    h = torch.randn(7, 64)
    med = build_head(HeadConfig(head_type="medusa", medusa_num_heads=2), target)
    _, s = med.train_forward(PackedBatch(ids, [4, 3], h, None, mask))
    # head 0 at row i predicts t_{i+2} (target row i+1), head 1 predicts t_{i+3} (target row i+2)
    assert s.next_tokens[:, 0].tolist() == [12, 13, -100, -100, 22, -100, -100]
    assert s.token_mask[:, 0].tolist() == [1, 0, 0, 0, 1, 0, 0]
    assert s.next_tokens[:, 1].tolist() == [13, -100, -100, -100, -100, -100, -100]
    assert s.token_mask[:, 1].tolist() == [0, 0, 0, 0, 0, 0, 0]
    assert s.target_rows[:2, 0].tolist() == [1, 2] and s.target_rows[4, 0] == 5
    lm = build_head(HeadConfig(head_type="draft_lm"), target)
    _, s = lm.train_forward(PackedBatch(ids, [4, 3], h, None, mask))
    assert s.next_tokens.tolist() == [11, 12, 13, -100, 21, 22, -100]
    assert s.token_mask.tolist() == [1, 1, 0, 0, 0, 1, 0]
    assert s.target_rows.tolist() == list(range(7))


# ---------------------------------------------------------------------------------------- data


def test_stream_packs_shuffles_per_epoch_splits_ranks_and_resumes():
    lens = [5, 9, 3, 7, 8, 4, 6, 10, 3, 5]
    src = TokenSequences([[1] * n for n in lens], [[1] * n for n in lens])
    s = PackedStream(src, batch_tokens=16, seed=1, epochs=3)
    e0, e1 = s.epoch_batches(0), s.epoch_batches(1)
    assert e0 != e1 and sorted(i for b in e0 for i in b) == list(range(10))
    assert all(sum(lens[i] for i in b) <= 16 for b in e0)
    assert s.epoch_batches(0) == e0  # deterministic
    full = [it["batch"].input_ids.numel() for it in s]
    resumed = PackedStream(src, batch_tokens=16, seed=1, epochs=3)
    resumed.skip = 5
    assert [it["batch"].input_ids.numel() for it in resumed] == full[5:]
    n0 = len(e0)
    crossing = PackedStream(src, batch_tokens=16, seed=1, epochs=3)
    crossing.skip = n0 + 2  # into the second epoch
    assert [it["batch"].input_ids.numel() for it in crossing] == full[n0 + 2:]
    assert [it["epoch"] for it in PackedStream(src, 16, 1, epochs=2)] == [0] * n0 + [1] * len(e1)
    odd = next(e for e in range(20) if len(s.epoch_batches(e)) % 2)  # an epoch that does not split evenly
    r0 = PackedStream(src, 16, 1, rank=0, world=2).epoch_batches(odd)
    r1 = PackedStream(src, 16, 1, rank=1, world=2).epoch_batches(odd)
    whole = s.epoch_batches(odd)
    assert len(r0) == len(r1) == len(whole) // 2  # the tail that does not fill every rank is dropped
    assert r0 == whole[0:-1:2] and r1 == whole[1::2]
    workers = torch.utils.data.DataLoader(PackedStream(src, 16, 1, epochs=3), batch_size=1, num_workers=2,
                                          collate_fn=lambda x: x[0])
    assert [it["batch"].input_ids.numel() for it in workers] == full  # workers split, never repeat
    assert pack([0, 1, 2], lens, 14) == [[0, 1], [2]]
    with pytest.raises(DataError, match="batch_tokens=8 is smaller than the longest"):
        PackedStream(src, batch_tokens=8, seed=1)


# ----------------------------------------------------------------------------------- end to end


def test_train_writes_heads_metrics_and_validates_with_the_engine(tmp_path, chat_model_dir, capsys):
    path = _recipe(tmp_path, chat_model_dir, train={"ttt_steps": 2})
    assert main(["train", str(path), "--no-progress"]) == 0
    out = tmp_path / "run"
    for name in ("head-final", "head-best", "checkpoints/last.ckpt", "metrics.json", "metrics.csv", "train.json"):
        assert (out / name).exists(), name
    m = json.loads((out / "metrics.json").read_text())
    assert m["step"] == 6 and m["tokens"] > 0 and len(m["top1_per_step"]) == 2
    assert 1.0 <= m["tau"] <= 4.0 and len(m["accept_rate_per_pos"]) == 3 and m["val_loss"] > 0
    curve = _curve(out)
    assert [int(r["step"]) for r in curve if r["kind"] == "val"] == [3, 6]
    assert [int(r["step"]) for r in curve if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    # The callback measured the engine itself: the saved final head on the same prompts gives the same tau.
    recipe = load_recipe(path)
    from headstart.data.dataset import build_dataset
    from headstart.train.validate import heldout_prompts

    built = build_dataset(recipe.data, str(chat_model_dir), progress=False)
    prompts = heldout_prompts([list(x) for x in built.heldout["input_ids"]],
                              [list(x) for x in built.heldout["loss_mask"]], 3)
    tgt = load_llama(chat_model_dir, "fp32")
    head = load_head(out / "head-final", tgt)
    again = engine_acceptance(tgt, head, prompts, k=3, max_tokens=8, tokenizer=built.tokenizer, seed=3)
    assert again["tau"] == pytest.approx(m["tau"]) and again["steps"] == m["steps"]
    # A second run into the same directory is refused; head-final is a recognised head (not user data).
    capsys.readouterr()
    assert main(["train", str(path), "--no-progress"]) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_shards_and_online_give_the_same_first_losses(tmp_path, chat_model_dir):
    online = _recipe(tmp_path, chat_model_dir, name="online", train={"max_steps": 3, "val_every_steps": 0})
    shards = _recipe(tmp_path, chat_model_dir, name="shards", train={"max_steps": 3, "val_every_steps": 0,
                                                                     "source": "shards"})
    assert main(["precompute", str(shards)]) == 0
    assert main(["train", str(online), "--no-progress"]) == 0
    assert main(["train", str(shards), "--no-progress"]) == 0
    a, b = _losses(tmp_path / "online"), _losses(tmp_path / "shards")
    assert list(a) == [1, 2, 3]
    for step in a:  # shards hold bf16 hidden states, the online forward fp32
        assert b[step] == pytest.approx(a[step], rel=2e-2)


def test_shards_from_another_target_are_refused(tmp_path, chat_model_dir):
    from tiny_models import make_hf_model

    from headstart.train import run_train

    shards = _recipe(tmp_path, chat_model_dir, name="s", train={"source": "shards"})
    assert main(["precompute", str(shards)]) == 0
    other = tmp_path / "other-model"
    make_hf_model("llama", other, seed=99, vocab_size=len(__import__("conftest").make_tokenizer("chatml")))
    __import__("conftest").make_tokenizer("chatml").save_pretrained(other)
    recipe = load_recipe(shards, [f"target.model={other}", f"output_dir={tmp_path / 'o'}",
                                  f"train.shards_dir={tmp_path / 's' / 'precompute'}"])
    with pytest.raises(DataError, match="shards were computed with target"):
        run_train(recipe, progress=False)


def _cli(args, env=None):
    return subprocess.Popen([sys.executable, "-m", "headstart.cli", *args], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, chat_model_dir):
    train = {"max_steps": 12, "val_every_steps": 0, "ckpt_every_steps": 3, "val_prompts": 1}
    ref = _recipe(tmp_path, chat_model_dir, name="ref", train=train)
    p = _cli(["train", str(ref), "--no-progress"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    killed = _recipe(tmp_path, chat_model_dir, name="killed", train=train)
    out = tmp_path / "killed"
    proc = _cli(["train", str(killed), "--no-progress"])
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        logged = _losses(out) if (out / "metrics.csv").exists() else {}
        if (out / "checkpoints" / "last.ckpt").exists() and len(logged) >= 4:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _losses(out)
    assert 3 <= len(done) < 12, "the run was not interrupted mid-way"
    assert _cli(["train", str(killed), "--no-progress"]).wait() != 0  # without --resume: refused
    p = _cli(["train", str(killed), "--no-progress", "--resume"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    a, b = _losses(tmp_path / "ref"), _losses(out)
    assert list(b) == list(range(1, 13))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step


def test_resume_with_another_recipe_is_refused_naming_the_difference(tmp_path, chat_model_dir, capsys):
    path = _recipe(tmp_path, chat_model_dir, train={"max_steps": 2, "val_every_steps": 0})
    assert main(["train", str(path), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", str(path), "--no-progress", "--resume", "--set", "train.lr=0.01"]) == 2
    err = capsys.readouterr().err
    assert "train.lr" in err and "Traceback" not in err
    assert main(["train", str(path), "--no-progress", "--resume", "--set", "train.max_steps=3"]) == 0  # longer: fine


def test_two_gloo_processes_equal_one_with_accumulation(tmp_path, chat_model_dir):
    train = {"max_steps": 3, "val_every_steps": 0, "val_prompts": 1}
    one = _recipe(tmp_path, chat_model_dir, name="one", train={**train, "grad_accum": 2}, n=64)
    p = _cli(["train", str(one), "--no-progress"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    two = _recipe(tmp_path, chat_model_dir, name="two", train=train, n=64)
    p = _cli(["train", str(two), "--no-progress", "--set", "trainer.devices=2", "--set", "trainer.accelerator=cpu"])
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err.decode()[-3000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert list(a) == list(b) == [1, 2, 3]
    # Logged losses are one micro-batch's (rank 0's / the last accumulated): compare the updated heads.
    ha = load_head(tmp_path / "one" / "head-final", load_llama(chat_model_dir, "fp32"))
    hb = load_head(tmp_path / "two" / "head-final", load_llama(chat_model_dir, "fp32"))
    for (name, x), (_, y) in zip(ha.state_dict().items(), hb.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm"])
def test_every_head_family_trains(tmp_path, chat_model_dir, kind):
    extra = "  draft_vocab_size: 96\n" if kind in ("eagle3", "medusa") else ""
    path = _recipe(tmp_path, chat_model_dir, head=kind, extra=extra,
                   train={"max_steps": 2, "val_every_steps": 0, "val_prompts": 2, "ttt_steps": 2})
    assert main(["train", str(path), "--no-progress"]) == 0
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["tau"] is not None and m["val_loss"] > 0
    head = load_head(tmp_path / "run" / "head-final", load_llama(chat_model_dir, "fp32"))
    if kind in ("eagle3", "medusa"):
        assert head.d2t.numel() == 96 and int(head.d2t.max()) > 0  # the reduced vocabulary was installed


def test_bad_input_is_one_clear_line(tmp_path, chat_model_dir, capsys):
    small = _recipe(tmp_path, chat_model_dir, name="small", train={"batch_tokens": 16})
    assert main(["train", str(small), "--no-progress"]) == 2
    assert "train.batch_tokens=16 is smaller than the longest" in capsys.readouterr().err
    empty = _recipe(tmp_path, chat_model_dir, name="empty", n=1)
    assert main(["train", str(empty), "--no-progress", "--set", "data.heldout_fraction=0.99"]) == 2
    err = capsys.readouterr().err
    assert "training split is empty" in err and "Traceback" not in err
    noshards = _recipe(tmp_path, chat_model_dir, name="noshards", train={"source": "shards"})
    assert main(["train", str(noshards), "--no-progress"]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    many = _recipe(tmp_path, chat_model_dir, name="many", train={"val_prompts": 500, "max_steps": 1})
    assert main(["train", str(many), "--no-progress"]) == 0
    assert "validating on" in capsys.readouterr().out


def test_non_finite_losses_skip_steps_then_stop(tmp_path, chat_model_dir, capsys):
    path = _recipe(tmp_path, chat_model_dir, train={"lr": "1.0e+30", "max_bad_steps": 2, "grad_clip": 0.0,
                                                    "val_every_steps": 0})
    assert main(["train", str(path), "--no-progress"]) == 2
    out = capsys.readouterr()
    assert "non-finite loss" in out.out and "consecutive steps" in out.err


def test_auto_precision_follows_the_hardware(monkeypatch):
    from headstart import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert hardware.resolve_dtype("auto") == "fp32" and hardware.resolve_precision("auto", "cpu") == "32-true"
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert hardware.resolve_dtype("auto") == "bf16" and hardware.resolve_precision("auto", "cpu") == "bf16-mixed"
    assert hardware.resolve_dtype("fp16") == "fp16"


def test_precision_and_dtype_must_agree(tmp_path, chat_model_dir):
    from headstart.train import run_train

    recipe = load_recipe(_recipe(tmp_path, chat_model_dir), ["target.dtype=bf16"])
    with pytest.raises(ConfigError, match="trainer.precision 32-true"):
        run_train(recipe, progress=False)


def test_heldout_prompts_are_the_first_user_turn_with_the_generation_prompt(chat_model_dir):
    from headstart.config import DataConfig
    from headstart.data.dataset import build_dataset, load_tokenizer
    from headstart.train.validate import heldout_prompts

    rows = [{"id": "a", "conversations": [{"from": "human", "value": "hello heads"},
                                          {"from": "gpt", "value": "draft tokens fast"},
                                          {"from": "human", "value": "more"}, {"from": "gpt", "value": "the a"}]}]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = write_jsonl(Path(d) / "one.jsonl", rows)
        built = build_dataset(DataConfig(source=str(src), max_length=96, heldout_fraction=0.0), str(chat_model_dir),
                              progress=False)
    (prompt,) = heldout_prompts([list(x) for x in built.train["input_ids"]],
                                [list(x) for x in built.train["loss_mask"]], 5)
    tok = load_tokenizer(chat_model_dir)
    expected = tok.apply_chat_template([{"role": "user", "content": "hello heads"}], tokenize=True,
                                       add_generation_prompt=True)
    assert prompt == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_resume_with_accumulation_continues_exactly(tmp_path, chat_model_dir):
    """Checkpoints land on optimizer-step boundaries: stopping after step 2 of 4 (grad_accum 2) and
    resuming gives the same losses and head as one run (constant lr, so the schedule is the same)."""
    train = {"max_steps": 4, "grad_accum": 2, "ckpt_every_steps": 1, "val_every_steps": 0, "val_prompts": 1,
             "warmup_steps": 0, "min_lr_ratio": 1.0}
    one = _recipe(tmp_path, chat_model_dir, name="one", train=train)
    assert main(["train", str(one), "--no-progress"]) == 0
    two = _recipe(tmp_path, chat_model_dir, name="two", train=train)
    assert main(["train", str(two), "--no-progress", "--set", "train.max_steps=2"]) == 0
    assert main(["train", str(two), "--no-progress", "--resume"]) == 0
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert list(b) == [1, 2, 3, 4] and b == pytest.approx(a, rel=1e-6)
    ta = load_head(tmp_path / "one" / "head-final", load_llama(chat_model_dir, "fp32")).state_dict()
    tb = load_head(tmp_path / "two" / "head-final", load_llama(chat_model_dir, "fp32")).state_dict()
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=0, atol=0)
    vals = [int(r["step"]) for r in _curve(tmp_path / "two") if r["kind"] == "val"]
    assert vals == [2, 4]  # the resumed step is not validated twice


def test_more_bad_input_is_refused_before_any_work(tmp_path, chat_model_dir, capsys):
    path = _recipe(tmp_path, chat_model_dir, train={"max_steps": 2, "val_every_steps": 0, "val_prompts": 1})
    out = tmp_path / "run"

    def fails(*args, match):
        assert main(["train", str(path), "--no-progress", *args]) == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, err

    if not torch.cuda.is_available():
        fails("--set", "trainer.accelerator=gpu", match="no CUDA GPU is visible")
        fails("--set", "trainer.strategy=fsdp", match="fsdp needs GPUs")
    fails("--set", "head.type=eagle3", "--set", "train.loss_weights.kl=0", match="learns from the KL term only")
    out.mkdir(exist_ok=True)
    (out / "metrics.csv").write_text("my own numbers\n")
    fails(match="that no training run of headstart wrote")
    assert (out / "metrics.csv").read_text() == "my own numbers\n"
    (out / "metrics.csv").unlink()
    (out / "head-final").mkdir()
    (out / "head-final" / "notes.txt").write_text("mine")
    fails(match="head-final that no training run")
    (out / "train.json").write_text("{}")  # even inside a run's directory, a user's head-final stays
    fails(match="exists and is not empty")
    (out / "train.json").unlink()
    assert (out / "head-final" / "notes.txt").read_text() == "mine"
    (out / "head-final" / "notes.txt").unlink()
    (out / "head-final").rmdir()
    fails("--resume", match="holds no checkpoint to resume")
    (out / "train.json").write_text("{}")  # a run that died before its first checkpoint starts afresh
    assert main(["train", str(path), "--no-progress"]) == 0
    ckpt = out / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    fails("--resume", "--set", "train.max_steps=3", match="damaged")


def test_weights_and_biases_logs_offline_without_an_api_key(tmp_path, chat_model_dir, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    path = _recipe(tmp_path, chat_model_dir, train={"max_steps": 2, "val_every_steps": 0, "val_prompts": 1})
    assert main(["train", str(path), "--no-progress", "--set", "logging.wandb=true"]) == 0
    assert "logs offline" in capsys.readouterr().out
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
