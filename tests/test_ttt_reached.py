"""train.ttt_rows: reached — each unrolled step learns only from the rows the engine's greedy chain reaches.

The reference sequence is built so that the head's first draft is right exactly where the test says: each next
token is the head's own greedy pick at that row, or another token where the test wants a miss."""

import pytest
import torch
from test_train_parts import target  # noqa: F401 - module fixture shared

from headstart.errors import ConfigError
from headstart.heads import HeadConfig, PackedBatch, build_head, build_vocab_maps
from headstart.heads.vocab import target_ids
from headstart.nn.attention import packed_metadata
from headstart.train.losses import distill_steps
from headstart.train.module import target_forward
from headstart.train.ttt import reached_rows, unroll

AUX = [0, 1, 2]


def _head(target, draft_vocab=None):  # noqa: F811
    head = build_head(HeadConfig(head_type="eagle3", aux_layer_ids=AUX, draft_vocab_size=draft_vocab), target)
    if draft_vocab:
        d2t, t2d = build_vocab_maps(torch.rand(target.config.vocab_size, generator=torch.Generator().manual_seed(3)),
                                    draft_vocab)
        head.set_vocab_maps(d2t, t2d)
    return head


def _pick(head, ids):
    """The head's greedy first draft (a target id) after the prefix `ids`: the last row of step 0."""
    b = target_forward(head.target.model, PackedBatch(torch.tensor(ids), [len(ids)], None, None, None), AUX)
    outs, _, _ = unroll(head, b, 1)
    draft = int(head.compute_logits(outs[0][-1:]).argmax(-1))
    d2t = getattr(head, "d2t", None)
    return int(target_ids(d2t)[draft]) if d2t is not None and d2t.numel() != head.target.vocab_size else draft


def _reference(head, length, misses, seed=0):
    """A sequence whose token p + 2 is the head's pick at row p, except at the rows in `misses`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, head.target.vocab_size, (2,), generator=g).tolist()
    for p in range(length - 2):
        pick = _pick(head, ids)
        ids.append(pick if p not in misses else 2 + (pick - 1) % (head.target.vocab_size - 2))
    return ids


@pytest.mark.parametrize("draft_vocab", [None, 128])
def test_reached_rows_are_where_the_chain_of_greedy_drafts_holds(target, draft_vocab):  # noqa: F811
    head = _head(target, draft_vocab).eval()
    misses = {0, 3, 4, 9}
    seq = _reference(head, 14, misses)
    other = torch.randint(2, target.config.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    b = target_forward(target, PackedBatch(torch.tensor(seq + other), [14, 9], None, None, None), AUX)
    with torch.no_grad():
        outs, _, sh = unroll(head, b, 3)
    reach = reached_rows(head, outs, sh, chunk=5)
    assert all(r.device == outs[0].device and r.dtype == torch.bool for r in reach)
    rows = 13  # the first sequence's shifted rows; row 12 has no next token
    hit0 = [p not in misses and p < rows - 1 for p in range(rows)]
    assert reach[0].all()
    assert reach[1][:rows].tolist() == [False] + hit0[:-1]
    nxt, pos = sh.next_tokens, packed_metadata(sh.seq_lens).positions
    d2t = getattr(head, "d2t", None)
    ids = target_ids(d2t) if draft_vocab else torch.arange(target.config.vocab_size)
    for p in range(len(pos)):  # step 2, row by row: step 1 reached row p - 1 and its pick was right there
        right = p >= 1 and int(ids[head.compute_logits(outs[1][p - 1:p]).argmax(-1)]) == int(nxt[p - 1])
        assert bool(reach[2][p]) == (pos[p] >= 2 and bool(reach[1][p - 1]) and right), p
    assert not reach[1][rows] and not reach[2][rows] and not reach[2][rows + 1]  # the second sequence's first rows
    assert 0 < int(reach[1][:rows].sum()) < rows


def _module(target, head, rows, loss="kl"):  # noqa: F811
    from headstart.recipe_io import recipe_from_dict
    from headstart.train.module import HeadModule

    recipe = recipe_from_dict({"train": {"ttt_steps": 3, "ttt_rows": rows, "loss_chunk_tokens": 8, "loss": loss}})
    return HeadModule(recipe, target, head)


@pytest.mark.parametrize("loss", ["kl", "lk"])
def test_the_reached_loss_is_each_steps_loss_on_its_reached_rows_over_all_its_rows(target, loss):  # noqa: F811
    """KL: the sum over the reached rows over every row's count. LK: lambda follows the step's unconditional
    acceptance (the reached rows' sum of a over every row), the engine's acceptance rate at that position."""
    head = _head(target)
    seq = _reference(head, 16, {2, 7})
    b = target_forward(target, PackedBatch(torch.tensor(seq), [16], None, None, torch.ones(16, dtype=torch.uint8)),
                       AUX)
    module = _module(target, head, "reached", loss)
    got, stats = module.losses(b, with_stats=True)
    outs, _, sh = unroll(head, b, 3)
    reach = reached_rows(head, outs, sh, chunk=8)
    pos = packed_metadata(sh.seq_lens).positions
    every = [torch.nonzero((sh.token_mask > 0) & (pos >= j)).flatten() for j in range(3)]
    kept = [r[reach[j][r]] for j, r in enumerate(every)]
    assert 0 < kept[1].numel() < every[1].numel()
    parts = distill_steps(head, outs, b.hidden[sh.target_rows], kept, None, 8, with_stats=True, lk=loss == "lk")
    ref = torch.zeros(())
    for j, p in enumerate(parts):
        n = every[j].numel()
        if loss == "kl":
            step = p.kl / n
        else:
            mean_a = p.alpha / n
            lam = torch.exp(-3.0 * mean_a)
            step = lam * p.kl / n + (1 - lam) * (1 - mean_a)
        ref = ref + 0.8 ** j * step
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert stats["rows"] == [r.numel() for r in every]  # the log's top-1: the reached rows' hits over every row
    assert stats["correct"] == pytest.approx([float(p.correct) for p in parts])
    head.eval()  # held-out statistics: every supervised row, as with ttt_rows: all
    held, held_stats = module.losses(b, with_stats=True)
    every_loss, _ = _module(target, head, "all", loss).losses(b, with_stats=True)
    torch.testing.assert_close(held, every_loss)
    assert held_stats["rows"] == [r.numel() for r in every]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("lk", [False, True])
def test_row_weights_weigh_the_sums_and_gradients_and_keep_the_counts(target, fused, lk, monkeypatch):  # noqa: F811
    """distill_steps with 0/1 row weights == distill_steps on the kept rows (every sum, every gradient, in the
    fused chunks and the checkpointed ones), with each step's row count that of all its rows."""
    import headstart.train.losses as losses

    if not fused:
        monkeypatch.setattr(losses, "fused_projection", lambda *a: None)
    head = _head(target, 128)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, target.config.vocab_size, (30,), generator=g)
    b = target_forward(target, PackedBatch(ids, [17, 13], None, None, torch.ones(30, dtype=torch.uint8)), AUX)
    outs, _, sh = unroll(head, b, 3)
    th = b.hidden[sh.target_rows]
    pos = packed_metadata(sh.seq_lens).positions
    rows = [torch.nonzero((sh.token_mask > 0) & (pos >= j)).flatten() for j in range(3)]
    masks = [torch.ones(len(pos), dtype=torch.bool)] + [torch.rand(len(pos), generator=g) < 0.5 for _ in range(2)]
    kept = [r[m[r]] for r, m in zip(rows, masks)]
    assert all(0 < k.numel() < r.numel() for k, r in zip(kept[1:], rows[1:]))
    feat = th + 0.1  # a feature target (mtp, eagle1, deepseek_mtp): its smooth-L1 sums are weighted too
    weighted = distill_steps(head, outs, th, rows, feat, 5, lk=lk, row_weights=masks)
    direct = distill_steps(head, outs, th, kept, feat, 5, lk=lk)
    wrt = [*outs, *(p for p in head.trainable_parameters() if p.requires_grad)]
    sums = []
    for parts in (weighted, direct):
        total = sum((j + 1) * (p.kl + p.feature + (p.alpha + 0.5 * p.neglog_alpha if lk else 0))
                    for j, p in enumerate(parts))
        sums.append(torch.autograd.grad(total, wrt, retain_graph=True, allow_unused=True))
    for w, d, r in zip(weighted, direct, rows):
        assert w.rows == r.numel()
        for key in ("kl", "feature", "alpha", "neglog_alpha", "correct", "accept", "mass"):
            torch.testing.assert_close(getattr(w, key), getattr(d, key), rtol=1e-5, atol=1e-6, msg=key)
    for x, y in zip(*sums):
        if x is None or y is None:
            assert x is None and y is None
        else:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind, steps", [("medusa", 3), ("eagle3", 1)])
def test_reached_rows_need_a_chain_head_unrolled_twice(target, kind, steps):  # noqa: F811
    from headstart.recipe_io import recipe_from_dict
    from headstart.train.module import HeadModule

    extra = {"aux_layer_ids": AUX} if kind == "eagle3" else {}
    head = build_head(HeadConfig(head_type=kind, **extra), target)
    recipe = recipe_from_dict({"train": {"ttt_steps": steps, "ttt_rows": "reached"}})
    with pytest.raises(ConfigError, match="train.ttt_rows"):
        HeadModule(recipe, target, head)


def test_train_refuses_reached_rows_for_a_non_chain_head_before_the_target_loads(tmp_path, monkeypatch):
    import headstart.models as models
    from headstart.recipe_io import recipe_from_dict
    from headstart.train.run import TrainRun

    monkeypatch.setattr(models, "load_target", lambda *a, **kw: pytest.fail("the target loaded"))
    recipe = recipe_from_dict({"output_dir": str(tmp_path / "run"), "head": {"type": "medusa"},
                               "train": {"ttt_steps": 3, "ttt_rows": "reached"}})
    with pytest.raises(ConfigError, match="train.ttt_rows: reached"):
        TrainRun(recipe)
    assert not (tmp_path / "run").exists()
