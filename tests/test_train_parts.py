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

    from headstart.recipe_io import recipe_from_dict
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


# eagle3's EAGLE-3.1 flags: all off (EAGLE-3), the new defaults, per-state input norms with the post-norm
# state fed back, and the residual norm alone.
EAGLE31 = {"eagle3": dict.fromkeys(("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"), False),
           "eagle3.1": {}, "eagle3-fc_norm": {"fc_norm": True, "norm_before_residual": False},
           "eagle3-residual": {"norm_before_fc": False, "norm_before_residual": True, "norm_output": False}}


@pytest.mark.parametrize("kind", ["mtp", "eagle1", "deepseek_mtp", *EAGLE31])
def test_unrolled_step_j_is_the_engine_draft_step_j(target, kind):
    """Absorb positions 0..m with the target's states through the paged cache, then draft steps
    j = 1..3 one row each (own output fed back, ground-truth tokens): step j of the unroll at row
    m + j computes the same hidden state."""
    kw = {"aux_layer_ids": [0, 1, 2], **EAGLE31[kind]} if kind in EAGLE31 else {}
    kind = "eagle3" if kind in EAGLE31 else kind
    head = build_head(HeadConfig(head_type=kind, **kw), target).eval()
    with torch.no_grad():  # the flags' norms away from one, so that a norm applied twice or skipped shows
        for name, p in head.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.5 * torch.rand_like(p))
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


def test_max_sequences_cuts_the_stream_to_the_first_rows_on_every_rank():
    """train.max_sequences=5 trains on rows 0..4 only (row 1 is too short to supervise: rows are cut, not
    usable rows), on every rank and epoch, resumes inside the cut, accepts the whole split and refuses more."""
    lens = [5, 2, 9, 3, 7, 8, 4, 6, 10, 3]
    src = TokenSequences([[1] * n for n in lens], [[1] * n for n in lens])
    cut = PackedStream(src, batch_tokens=16, seed=1, epochs=3, sequences=5)
    for e in range(3):
        assert sorted(i for b in cut.epoch_batches(e) for i in b) == [0, 2, 3, 4]
    ranks = [PackedStream(src, 16, 1, rank=r, world=2, sequences=5).epoch_batches(e) for r in (0, 1) for e in (0, 1)]
    assert {i for r in ranks for b in r for i in b} <= {0, 2, 3, 4} and all(ranks)
    full = [it["batch"].input_ids.numel() for it in cut]
    resumed = PackedStream(src, batch_tokens=16, seed=1, epochs=3, sequences=5)
    resumed.skip = 2
    assert [it["batch"].input_ids.numel() for it in resumed] == full[2:] and sum(full) == 3 * (5 + 9 + 3 + 7)
    whole = PackedStream(src, 16, 1, sequences=len(lens))
    assert whole.epoch_batches(0) == PackedStream(src, 16, 1).epoch_batches(0)
    with pytest.raises(DataError, match="train.max_sequences=11 but the training split holds 10 sequences"):
        PackedStream(src, 16, 1, sequences=11)
    with pytest.raises(DataError, match=r"split \(train.max_sequences=2\) holds no sequence of 3"):
        PackedStream(TokenSequences([[1] * 2, [1] * 2, [1] * 5], [[1] * 2, [1] * 2, [1] * 5]), 16, 1, sequences=2)


# ------------------------------------------------------------------- tests that catch planted bugs


@pytest.mark.parametrize("kind", ["mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm"])
def test_every_head_parameter_is_optimised_once_and_moves(target, kind):
    """Each head parameter is trainable, in exactly one optimiser group, and changed by three steps
    from the default start (catches a frozen fusion, an emptied norm/bias group, a detached input)."""
    from headstart.recipe_io import recipe_from_dict
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

    from headstart.nn.attention import PackedCausalAttention
    from headstart.recipe_io import recipe_from_dict
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
    from headstart.train.outputs import CurveWriter

    p = tmp_path / "metrics.csv"
    p.write_text("kind,step,tokens,loss,lr,tok_s,val_loss,tau,alpha,top1_per_step,expected_accept_per_step,"
                 "accept_rate_per_pos\nval,5,100,,,,2.0,1.5,0.2,[0.3],[0.25],[0.4]\ntrain,9,200,1.0,0.1,50,,,,,,\n")
    CurveWriter(p).start(5)
    import csv

    rows = list(csv.DictReader(p.open()))
    assert [r["step"] for r in rows] == ["5"] and rows[0]["sampled_accept_per_step"] == "[0.25]"


def test_the_loader_pins_every_tensor_of_a_packed_batch(monkeypatch):
    """DataLoader(pin_memory=True) passes an object without a pin_memory method through unpinned, so the
    step's non_blocking copies would be synchronous. No CUDA here: the pinning itself is recorded."""
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: pinned.append(t) or t.clone())
    batch = PackedBatch(torch.arange(6), [3, 3], torch.randn(6, 4), torch.randn(6, 2, 4), torch.ones(6),
                        torch.ones(6), None)
    out = pin_memory(batch)
    assert isinstance(out, PackedBatch) and out.seq_lens == [3, 3] and out.aux_scale is None
    assert len(pinned) == 5 and all(any(p is getattr(batch, f) for p in pinned)
                                    for f in ("input_ids", "hidden", "aux_hidden", "loss_mask", "hidden_scale"))
    assert torch.equal(out.hidden, batch.hidden) and out.hidden is not batch.hidden


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_training_loader_hands_over_pinned_batches_on_cuda(target):
    """The training DataLoader (collate, pin_memory=True as TrainData sets it on CUDA): every tensor of the
    micro-batch the step receives is page-locked, so its copies to the device do not wait."""
    from torch.utils.data import DataLoader

    from headstart.train.data import collate

    b = _batch(target)
    item = {"batch": PackedBatch(b.input_ids, b.seq_lens, b.hidden, b.aux_hidden, b.loss_mask)}
    got = next(iter(DataLoader([item], batch_size=1, collate_fn=collate, pin_memory=True)))["batch"]
    assert all(t.is_pinned() for t in (got.input_ids, got.hidden, got.aux_hidden, got.loss_mask))
