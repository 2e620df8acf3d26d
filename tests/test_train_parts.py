"""Training pieces on a tiny random target: the chunked losses (exact, with their gradient, flat in
memory), the module's weighted loss, the TTT unroll against the engine's draft steps, the Shifted
contract of Medusa / draft_lm, and the data stream (packing, epochs, ranks, workers, resume)."""

import pytest
import torch

from headstart.errors import DataError
from headstart.heads import HeadConfig, PackedBatch, build_head, build_vocab_maps
from headstart.inference.backends import TorchAttention
from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator
from headstart.inference.runner import build_metadata
from headstart.models.llama import load_llama
from headstart.nn.attention import packed_metadata
from headstart.train.data import PackedStream, TokenSequences, pack
from headstart.train.losses import distill, target_logits
from headstart.train.module import target_forward
from headstart.train.ttt import unroll


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny_models import make_hf_model

    d = tmp_path_factory.mktemp("target")
    make_hf_model("llama", d, seed=5, vocab_size=512)
    return load_llama(d, "fp32")


@pytest.fixture(scope="module")
def deepseek_target(tmp_path_factory):
    """A tiny DeepSeek-V2-Lite-shaped target (MLA + MoE): its deepseek_mtp head is the target's own block."""
    from test_deepseek import CONFIGS, _hf_model

    from headstart.models import load_target

    d = tmp_path_factory.mktemp("deepseek")
    kind, overrides = CONFIGS["v2-lite"]
    _hf_model(kind, overrides).save_pretrained(d)
    return load_target(d, "fp32")


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


@pytest.mark.parametrize("draft_vocab", [None, 96])
def test_the_teacher_runs_once_per_chunk_for_every_ttt_step(target, draft_vocab, monkeypatch):
    """With TTT 4 the target's lm_head runs once per row chunk in the forward pass and once in its
    recompute, not once per step; the loss and its gradient are those of four separate distills."""
    import headstart.train.losses as losses
    from headstart.config import recipe_from_dict
    from headstart.train.module import HeadModule

    kw = {"aux_layer_ids": [0, 1, 2], "draft_vocab_size": draft_vocab}
    head = build_head(HeadConfig(head_type="eagle3", **kw), target)
    if draft_vocab:
        d2t, t2d = build_vocab_maps(torch.rand(target.config.vocab_size), draft_vocab)
        head.set_vocab_maps(d2t, t2d)
    recipe = recipe_from_dict({"train": {"ttt_steps": 4, "loss_chunk_tokens": 16}})
    module = HeadModule(recipe, target, head)
    b = _batch(target, lens=(21, 9, 30))
    calls = []
    for name in ("target_logits", "restricted_target_logits"):
        real = getattr(losses, name)
        monkeypatch.setattr(losses, name, lambda *a, _real=real: calls.append(1) or _real(*a))
    loss, stats = module.losses(b, with_stats=False)
    loss.backward()
    union = stats["rows"][0]
    chunks = -(-union // 16)
    assert len(calls) == 2 * chunks, (len(calls), chunks)  # forward + recompute, whatever the step count
    got = [p.grad.clone() for p in head.trainable_parameters() if p.grad is not None]
    monkeypatch.undo()
    head.zero_grad(set_to_none=True)
    outs, _, sh = unroll(head, b, 4)
    th = b.hidden[sh.target_rows]
    pos = packed_metadata(sh.seq_lens).positions
    ref = 0.0
    for j, out in enumerate(outs):
        rows = torch.nonzero((sh.token_mask > 0) & (pos >= j)).flatten()
        part = distill(head, out, th, rows, None, 16, with_stats=False)
        ref = ref + recipe.train.ttt_decay ** j * part.kl / part.rows
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for x, y in zip(got, [p.grad for p in head.trainable_parameters() if p.grad is not None]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["mtp", "eagle3", "dflash"])
def test_a_training_step_waits_for_the_device_once(target, kind, tmp_path):
    """The real training_step (Lightning, manual optimisation, TTT 3 / a dflash block) on micro-batches
    that are not logged: its one host sync is the non-finite check every rank agrees on. On CPU a tensor
    made from a host value with device=... looks like host data, so this sees syncs on computed values
    (a float(loss) per step, nonzero of a computed mask: headstart.train.syncs); the CUDA test below sees
    every one."""
    import lightning as L

    from headstart.config import recipe_from_dict
    from headstart.train.module import HeadModule
    from headstart.train.syncs import DeviceSyncCounter

    extra = {"aux_layer_ids": [0, 1, 2]} if kind in ("eagle3", "dflash") else {}
    if kind == "dflash":
        extra["block_size"] = 4
    recipe = recipe_from_dict({"head": {"type": kind, **extra}, "logging": {"wandb": False, "every_steps": 100},
                               "train": {"ttt_steps": 3, "grad_accum": 2, "warmup_steps": 0, "max_steps": 2}})
    head = build_head(HeadConfig(head_type=kind, **extra), target)
    module = HeadModule(recipe, target, head)
    batches = [_batch(target, lens=(21, 9, 30), seed=i) for i in range(4)]
    counts = []
    real_step = module.training_step

    def counted(item, batch_idx):
        b = item["batch"]
        counter = DeviceSyncCounter([*head.parameters(), *head.buffers(), b.input_ids, b.hidden, b.aux_hidden])
        with counter:
            real_step(item, batch_idx)
        counts.append(counter.syncs)

    module.training_step = counted
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(tmp_path))
    loader = torch.utils.data.DataLoader([{"batch": b} for b in batches], batch_size=None, collate_fn=lambda x: x)
    trainer.fit(module, train_dataloaders=loader)
    assert len(counts) == 4 and all(len(c) == 1 for c in counts), counts


@pytest.mark.cuda
def test_a_cuda_training_step_waits_for_the_device_once(tmp_path):
    """torch's own sync detector on a GPU: one warning per micro-batch (the non-finite check)."""
    import warnings

    import lightning as L
    from tiny_models import make_hf_model

    from headstart.config import recipe_from_dict
    from headstart.train.module import HeadModule

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    make_hf_model("llama", tmp_path / "m")
    target = load_llama(tmp_path / "m", "fp32").cuda()
    recipe = recipe_from_dict({"logging": {"wandb": False, "every_steps": 100},
                               "train": {"ttt_steps": 3, "warmup_steps": 0, "max_steps": 3}})
    head = build_head(HeadConfig(head_type="mtp"), target)
    module = HeadModule(recipe, target, head)
    batches = [_batch(target, lens=(21, 9, 30), seed=i) for i in range(3)]
    counts = []
    real_step = module.training_step

    def counted(item, batch_idx):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                real_step(item, batch_idx)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append([str(w.message)[:80] for w in seen if "synchroniz" in str(w.message)])

    module.training_step = counted
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=3, max_epochs=1, logger=False, precision="32-true",
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(tmp_path))
    loader = torch.utils.data.DataLoader([{"batch": b} for b in batches], batch_size=None, collate_fn=lambda x: x)
    trainer.fit(module, train_dataloaders=loader)
    assert len(counts) == 3 and all(len(c) <= 1 for c in counts), counts


def test_train_compile_gives_the_eager_loss_and_falls_back_naming_what_failed(target, monkeypatch, capsys):
    """train.compile: the head's forward and logits through inductor give the eager loss and gradients
    (TTT 2, on CPU); a function that does not compile runs eagerly, said once, with the same result."""
    import headstart.train.module as module_py
    from headstart.config import recipe_from_dict
    from headstart.train.module import HeadModule

    b = _batch(target, lens=(21, 9, 30))

    def run(compile_):
        torch.manual_seed(0)
        head = build_head(HeadConfig(head_type="mtp"), target)
        recipe = recipe_from_dict({"train": {"ttt_steps": 2, "compile": compile_}})
        loss, _ = HeadModule(recipe, target, head).losses(b, with_stats=False)
        loss.backward()
        return loss.detach(), [p.grad for p in head.trainable_parameters() if p.grad is not None]

    eager = run(False)
    compiled = run(True)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for x, y in zip(compiled[1], eager[1]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    assert "runs eagerly" not in capsys.readouterr().err

    def broken(fn, **kw):
        def fails(*a, **k):
            raise RuntimeError("inductor: no C++ compiler\nmore detail")
        return fails

    monkeypatch.setattr(module_py.torch, "compile", broken)
    fallback = run(True)
    err = capsys.readouterr().err
    assert "train.compile: mtp.forward_hidden runs eagerly: it did not compile (RuntimeError: inductor: no C++" in err
    assert err.count("forward_hidden runs eagerly") == 1  # said once, not per step
    torch.testing.assert_close(fallback[0], eager[0], rtol=0, atol=0)


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


@pytest.mark.parametrize("kind", ["mtp", "eagle3", "deepseek_mtp"])
def test_batched_ttt_attention_equals_the_looped_one_with_its_gradient(target, deepseek_target, kind, monkeypatch):
    """One attention call per unrolled step over all packed rows gives what the loop over sequences and
    query blocks gave (tests/ttt_reference.py), forward and backward, at fp32, on sequences of several
    lengths (a neighbour leaking in, or a key off by one row, shows)."""
    from ttt_reference import use_looped

    model = deepseek_target if kind == "deepseek_mtp" else target
    kw = {"aux_layer_ids": [0, 1, 2]} if kind == "eagle3" else {}
    head = build_head(HeadConfig(head_type=kind, **kw), model)
    b = _batch(model, lens=(11, 7, 14, 3))

    def run():
        head.zero_grad(set_to_none=True)
        outs, valid, _ = unroll(head, b, 4)
        loss = sum((o[v] ** 2).mean() * (j + 1) for j, (o, v) in enumerate(zip(outs, valid)))
        loss.backward()
        # Rows p < j have no history at step j and are left out of every loss: only valid rows are compared.
        return [o[v].detach() for o, v in zip(outs, valid)], [p.grad.clone() for p in head.trainable_parameters()
                                                               if p.grad is not None]

    got_o, got_g = run()
    with monkeypatch.context() as m:
        use_looped(m)
        ref_o, ref_g = run()
    for x, y in zip(got_o, ref_o):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert len(got_g) == len(ref_g) >= 8  # fc, the layer's projections and norms (not the unused lm_head)
    for x, y in zip(got_g, ref_g):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_batched_ttt_attention_keeps_no_scores_for_backward(target, monkeypatch):
    """What autograd saves for the unrolled steps: no per-head score tensor (B, H, L, keys), only the
    steps' 2-D masks, which the layers and sequences share; the same check on a plain softmax(q k^T)
    finds the scores."""
    import headstart.train.ttt as ttt

    head = build_head(HeadConfig(head_type="mtp"), target)
    b = _batch(target, lens=(101, 60))
    length = 100  # the longest shifted sequence

    def scores_saved():
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            unroll(head, b, 3)
        return [sh for sh in shapes if len(sh) >= 3 and min(sh[-2:]) >= length]

    assert scores_saved() == []

    def plain(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):  # keeps the probabilities
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        if attn_mask is None:
            n = q.shape[-2]
            attn_mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(q @ k.transpose(-1, -2) * scale + attn_mask, dim=-1) @ v

    monkeypatch.setattr(ttt.F, "scaled_dot_product_attention", plain)
    assert scores_saved()


def test_ttt_attention_calls_do_not_grow_with_the_sequences(target):
    """The same 48 rows packed as 1, 4 or 12 sequences run the same aten ops (no loop over sequences)."""
    from torch.profiler import profile

    head = build_head(HeadConfig(head_type="mtp"), target)
    counts = []
    for lens in ((49,), (13, 13, 13, 13), (5,) * 12 + (1,)):
        b = _batch(target, lens=lens)
        with profile() as prof:
            outs, _, _ = unroll(head, b, 3)
            sum(o.sum() for o in outs).backward()
        counts.append(sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention"))
    assert counts[0] == counts[1] == counts[2] == 3 * head.kv_layers(), counts


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




# ------------------------------------------------------------------- tests that catch planted bugs


@pytest.mark.parametrize("kind", ["mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm"])
def test_every_head_parameter_is_optimised_once_and_moves(target, kind):
    """Each head parameter is trainable, in exactly one optimiser group, and changed by three steps
    from the default start (catches a frozen fusion, an emptied norm/bias group, a detached input)."""
    from headstart.config import recipe_from_dict
    from headstart.train.module import HeadModule

    cfg = HeadConfig(head_type=kind, aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None)
    head = build_head(cfg, target)
    module = HeadModule(recipe_from_dict({"train": {"ttt_steps": 2, "lr": 1e-2, "warmup_steps": 0}}), target, head)
    opt = module.configure_optimizers()["optimizer"]
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    named = dict(head.named_parameters())
    assert sorted(grouped) == sorted(id(p) for p in named.values()), "every parameter in exactly one group"
    assert all(p.requires_grad for p in named.values()), [n for n, p in named.items() if not p.requires_grad]
    assert any(p.ndim < 2 for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]) == any(
        p.ndim < 2 for p in named.values())
    before = {n: p.detach().clone() for n, p in named.items()}
    b = _batch(target)
    for _ in range(3):
        loss, _ = module.losses(b, with_stats=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
    still = [n for n, p in named.items() if torch.equal(p.detach(), before[n])]
    assert not still, f"unchanged after 3 steps: {still}"


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_ttt_feeds_the_previous_step_back_with_its_gradient(target, kind):
    """Step j's output depends on step j-1's (the draft feeds its own state back), and the loss of
    step j sends gradient into step j-1: a detached feedback would train step j on constants."""
    head = build_head(HeadConfig(head_type=kind, aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None), target,
                      init_from_target=False)
    outs, valid, _ = unroll(head, _batch(target), 3)
    for j in (1, 2):
        (g,) = torch.autograd.grad(outs[j][valid[j]].sum(), outs[j - 1], retain_graph=True, allow_unused=True)
        assert g is not None and g.abs().sum() > 0, f"step {j} does not see step {j - 1}"


@pytest.mark.parametrize("postnorm", [False, True])
def test_module_loss_on_a_hand_built_three_token_example(target, postnorm):
    """One sequence t0 t1 t2 with t2 supervised: the only row is (h0, t1) -> t2, so the loss is
    KL(p || q) + w_f * smoothL1(y / r, h1 / r) / d, with p = softmax(W norm(h1)) of the target,
    q = softmax(W norm_head(y)), y the mtp head's output on fc(cat(n_e(E t1), n_h(h0))) and r = RMS(h1),
    everything written out here instead of taken from the training code."""
    import torch.nn.functional as F

    from headstart.config import recipe_from_dict
    from headstart.nn.attention import PackedCausalAttention, packed_metadata
    from headstart.train.module import HeadModule

    head = build_head(HeadConfig(head_type="mtp", postnorm_features=postnorm or None), target, init_from_target=False)
    module = HeadModule(recipe_from_dict({"train": {"ttt_steps": 1, "loss_weights": {"kl": 1.0, "feature": 0.25}}}),
                        target, head)
    ids = torch.tensor([5, 9, 17])
    b = target_forward(target, PackedBatch(ids, [3], None, None, torch.tensor([0, 0, 1], dtype=torch.uint8)), [])
    h0, h1 = b.hidden[0:1], b.hidden[1:2]
    with torch.no_grad():
        # A postnorm head reads norm(h) and regresses onto norm(h1); the teacher is p either way.
        f0, f1 = (target.model.norm(h0), target.model.norm(h1)) if postnorm else (h0, h1)
        loss, stats = module.losses(b)
        x = head.fc(torch.cat([head.embed_norm(target.model.embed_tokens(ids[1:2])), head.hidden_norm(f0)], -1))
        y = head.layers[0](x, packed_metadata([1]), None, PackedCausalAttention())
        w = target.lm_head.weight
        logp = torch.log_softmax(target.model.norm(h1) @ w.T, -1)
        logq = torch.log_softmax(head.norm(y) @ w.T, -1)
        kl = (logp.exp() * (logp - logq)).sum()
        r = f1.pow(2).mean().sqrt()
        feat = F.smooth_l1_loss(y / r, f1 / r, reduction="sum") / f1.shape[-1]
    assert stats["rows"] == [1]
    torch.testing.assert_close(loss, kl + 0.25 * feat, rtol=1e-5, atol=1e-6)


def test_a_resumed_curve_keeps_rows_written_under_the_old_column_name(tmp_path):
    from headstart.train.run import CurveWriter

    p = tmp_path / "metrics.csv"
    p.write_text("kind,step,tokens,loss,lr,tok_s,val_loss,tau,alpha,top1_per_step,expected_accept_per_step,"
                 "accept_rate_per_pos\nval,5,100,,,,2.0,1.5,0.2,[0.3],[0.25],[0.4]\ntrain,9,200,1.0,0.1,50,,,,,,\n")
    CurveWriter(p).start(5)
    import csv

    rows = list(csv.DictReader(p.open()))
    assert [r["step"] for r in rows] == ["5"] and rows[0]["sampled_accept_per_step"] == "[0.25]"
