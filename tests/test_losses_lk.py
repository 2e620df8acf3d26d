"""The LK losses (train.loss: lk_alpha / lk_lambda; arXiv 2602.23881): the acceptance rate
a = sum_x min(p(x), q(x)) computed in the chunked loss path, its value and gradient against a direct
computation by autograd, with and without a draft vocabulary, and the module's combination."""

from __future__ import annotations

import pytest
import test_train_parts as parts
import torch

from headstart.errors import ConfigError
from headstart.heads import HeadConfig, build_head, build_vocab_maps
from headstart.recipe_io import recipe_from_dict
from headstart.train.losses import LossParts, distill, objective, target_logits

target, _batch = parts.target, parts._batch  # test_train_parts' tiny target (a fixture) and its batches


def _draft_vocab_head(target):
    head = build_head(HeadConfig(head_type="eagle3", aux_layer_ids=[0, 1, 2], draft_vocab_size=96), target)
    d2t, _ = build_vocab_maps(torch.arange(512, 0, -1).float(), 96)
    d2t = d2t + 7 * (torch.arange(96) >= 40)  # a non-trivial map
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[torch.arange(96) + d2t] = True
    head.set_vocab_maps(d2t, t2d)
    return head, torch.arange(96) + d2t


@pytest.mark.parametrize("vocab", ["full", "draft"])
def test_acceptance_and_its_log_equal_the_direct_formula_with_their_gradients(target, vocab):
    """Chunks of 3 rows; a with a draft vocabulary reads the target's full distribution on the draft
    tokens, not renormalised (its mass outside them is never accepted)."""
    if vocab == "full":
        head, ids = build_head(HeadConfig(head_type="mtp"), target), None
    else:
        head, ids = _draft_vocab_head(target)
    b = _batch(target)
    rows = torch.tensor([0, 3, 4, 9, 10, 20, 30])
    for which in ("alpha", "neglog_alpha"):
        hh = (torch.randn(b.input_ids.numel(), 64, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
        part = distill(head, hh, b.hidden, rows, None, chunk=3, with_stats=False, lk=True)
        getattr(part, which).backward()
        chunked = hh.grad.clone()
        hh.grad = None
        q = torch.softmax(head.compute_logits(hh[rows]), -1)
        p = torch.softmax(target_logits(head, b.hidden[rows]), -1)
        p = p if ids is None else p[:, ids]
        a = torch.minimum(p, q).sum(-1)
        direct = a.sum() if which == "alpha" else -a.log().sum()
        direct.backward()
        torch.testing.assert_close(getattr(part, which), direct.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(chunked, hh.grad, rtol=1e-4, atol=1e-7)
        assert float(chunked.abs().sum()) > 0
    if ids is not None:  # below the mass the target puts on the draft tokens
        assert float(part.alpha.detach()) < float(p.sum())


def test_the_kl_path_computes_no_acceptance(target):
    head = build_head(HeadConfig(head_type="mtp"), target)
    b = _batch(target)
    part = distill(head, torch.randn(b.input_ids.numel(), 64), b.hidden, torch.arange(10), None, chunk=4)
    assert float(part.alpha) == 0 and float(part.neglog_alpha) == 0 and float(part.kl.detach()) > 0


def test_lk_lambda_weighs_kl_and_tv_by_the_detached_mean_acceptance():
    kl = torch.tensor(6.0, requires_grad=True)
    alpha = torch.tensor(1.5, requires_grad=True)
    part = LossParts(kl, torch.zeros(()), 3, alpha=alpha, neglog_alpha=torch.tensor(2.4))
    loss = objective(part, "lk_lambda", kl_scale=0.9, kl_decay=3.0)
    lam = 0.9 * torch.exp(torch.tensor(-3.0 * 0.5))
    torch.testing.assert_close(loss, lam * 2.0 + (1 - lam) * 0.5)
    loss.backward()
    torch.testing.assert_close(kl.grad, lam / 3)  # no gradient through the weight
    torch.testing.assert_close(alpha.grad, -(1 - lam) / 3)
    assert float(objective(part, "lk_alpha")) == pytest.approx(0.8)
    assert float(objective(part, "kl")) == pytest.approx(2.0)
    empty = LossParts(torch.zeros(()), torch.zeros(()), 0)
    assert float(objective(empty, "lk_lambda", 0.5)) == 0.0  # no supervised row: no loss


def _losses(target, b, loss, head_type="eagle3", **train):
    from headstart.train.module import HeadModule

    torch.manual_seed(0)
    cfg = HeadConfig(head_type=head_type, aux_layer_ids=[0, 1, 2] if head_type in ("eagle3", "dflash") else None,
                     block_size=4 if head_type == "dflash" else None)
    head = build_head(cfg, target)
    recipe = recipe_from_dict({"train": {"ttt_steps": 2, "loss": loss, **train},
                               "head": {"type": head_type}})
    module = HeadModule(recipe, target, head)
    total, stats = module.losses(b, with_stats=True)
    total.backward()
    return total, stats, [p.grad.clone() for p in head.trainable_parameters() if p.grad is not None]


@pytest.mark.parametrize("head_type", ["eagle3", "mtp", "medusa", "dflash"])
def test_the_module_trains_each_lk_loss_as_documented(target, head_type):
    """TTT 2: sum_j decay^j * objective_j for chain heads; each loss moves the head's weights; lk is lk_lambda;
    the logged KL and acceptance are the same statistics whatever the loss."""
    b = _batch(target, lens=(40, 33, 50) if head_type == "dflash" else (11, 7, 14))
    kl, kl_stats, _ = _losses(target, b, "kl", head_type)
    alpha, a_stats, g_alpha = _losses(target, b, "lk_alpha", head_type)
    lam, _, g_lam = _losses(target, b, "lk_lambda", head_type)
    lk, _, g_lk = _losses(target, b, "lk", head_type)
    torch.testing.assert_close(lk, lam)
    assert all(torch.equal(x, y) for x, y in zip(g_lk, g_lam))
    assert float(alpha) > 0 and float(kl) > 0 and float(lam) != float(kl)
    assert g_alpha and all(torch.isfinite(g).all() for g in g_alpha)
    assert kl_stats["accept"] == pytest.approx(a_stats["accept"]) and kl_stats["kl"] == pytest.approx(a_stats["kl"])
    if head_type in ("eagle3", "mtp"):  # chain heads: the decayed sum of the steps' mean -log a
        rows, acc = a_stats["rows"], a_stats["accept"]
        assert len(rows) == 2 and float(alpha) > -sum(0.8 ** j * torch.log(torch.tensor(acc[j] / rows[j]))
                                                        for j in range(2)) - 1e-6  # Jensen: mean(-log a) >= -log mean a


def test_the_recipe_names_a_bad_loss():
    with pytest.raises(ConfigError, match="train.loss"):
        recipe_from_dict({"train": {"loss": "tv"}})
    with pytest.raises(ConfigError, match="train.lk_kl_scale"):
        recipe_from_dict({"train": {"loss": "lk", "lk_kl_scale": 0}})
    with pytest.raises(ConfigError, match="train.lk_kl_decay"):
        recipe_from_dict({"train": {"loss": "lk", "lk_kl_decay": -1}})
    with pytest.raises(ConfigError, match="kl weighs the distribution loss"):
        recipe_from_dict({"train": {"loss": "lk_alpha", "loss_weights": {"kl": 0, "feature": 1}}})
    assert recipe_from_dict({"train": {"loss": "lk"}}).train.lk_kl_decay == 3.0


@pytest.mark.parametrize("vocab", ["full", "draft"])
@pytest.mark.parametrize("lk", [False, True])
def test_the_bytes_a_loss_chunk_keeps_for_backward_are_within_what_plan_counts(target, vocab, lk):
    """What one chunk's loss saves for its backward (every (R, *) tensor the autograd graph keeps, counted by
    saved_tensors_hooks), for 3 draft steps, is at most chunk_row_bytes per row: the figure that sizes a GPU's
    chunk and that `headstart plan` adds up (the LK losses keep more than the KL)."""
    from headstart.sizing import chunk_row_bytes
    from headstart.train.losses import _chunk_kl

    if vocab == "full":
        head, ids = build_head(HeadConfig(head_type="mtp"), target), None
    else:
        head, ids = _draft_vocab_head(target)
    rows, steps = 64, 3
    b = _batch(target, lens=(40, 30))
    hh = [torch.randn(rows, 64, requires_grad=True) for _ in range(steps)]
    saved = {}

    def pack(t):
        if t.dim() >= 1 and t.shape[0] == rows and t.numel() > rows * 64:  # the chunk's vocabulary-wide tensors
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _chunk_kl(head, ids, b.hidden[:rows], torch.ones(steps, rows), [None], lk, *hh)
    v = 96 if ids is not None else target.config.vocab_size
    assert 0 < sum(saved.values()) <= rows * chunk_row_bytes(v, steps, lk, target.config.vocab_size), (
        sum(saved.values()) / (rows * v * 4), chunk_row_bytes(v, steps, lk, target.config.vocab_size) / (v * 4))


def test_the_module_passes_the_recipes_lk_hyper_parameters(target, monkeypatch):
    """train.lk_kl_scale / lk_kl_decay reach the objective (a swapped or ignored key changes the loss)."""
    import headstart.train.module as module_py

    seen = []
    real = module_py.objective
    monkeypatch.setattr(module_py, "objective", lambda part, loss, scale, decay: seen.append((loss, scale, decay))
                        or real(part, loss, scale, decay))
    b = _batch(target)
    a, _, _ = _losses(target, b, "lk", "mtp", lk_kl_scale=0.5, lk_kl_decay=1.25)
    assert seen and set(seen) == {("lk_lambda", 0.5, 1.25)}
    default, _, _ = _losses(target, b, "lk", "mtp")
    assert float(a) != float(default)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("norm_output", [True, False])
@pytest.mark.parametrize("loss", ["kl", "lk_lambda", "lk_alpha"])
def test_the_fused_chunks_equal_the_checkpointed_ones(target, monkeypatch, loss, norm_output, autocast):
    """train.losses.FusedChunks (CPU, eagle3's own draft lm_head: the gradient taken in the forward pass) against the
    checkpointed chunks: two TTT steps over different rows, chunks of 5 rows, statistics on, the steps
    combined as the module does (decay, per-row means, LK's lambda) — the sums, the statistics and the
    gradients of both steps' states and of every head parameter (the norm's too when it is not the output's)."""
    import headstart.train.losses as fused
    from headstart.sizing import grad_components
    from headstart.train.losses import distill_steps

    head, _ = _draft_vocab_head(target)
    head.config.norm_output = norm_output
    b = _batch(target)
    g = torch.Generator().manual_seed(3)
    states = [torch.randn(b.input_ids.numel(), 64, generator=g) * 2 for _ in range(2)]
    rows = [torch.tensor([0, 3, 4, 9, 10, 20, 30, 31]), torch.tensor([1, 3, 9, 12, 13, 20, 28])]

    def run():
        head.zero_grad(set_to_none=True)
        hh = [s.clone().requires_grad_() for s in states]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            parts = distill_steps(head, hh, b.hidden, rows, None, chunk=5, with_stats=True, lk=loss != "kl",
                                  grads=grad_components(loss))  # the trainer's: only the objective's gradients kept
        total = sum(0.8 ** j * objective(part, loss) for j, part in enumerate(parts))
        total.backward()
        sums = [torch.stack([p.kl, p.alpha, p.neglog_alpha, p.correct, p.accept, p.mass]).detach() for p in parts]
        return sums, [h.grad for h in hh], {n: p.grad for n, p in head.named_parameters() if p.grad is not None}

    calls = []
    real = fused.FusedChunks.apply
    monkeypatch.setattr(fused.FusedChunks, "apply", lambda *a: calls.append(1) or real(*a))
    got = run()
    assert calls, "the fused path did not run"
    monkeypatch.setattr(fused, "fused_projection", lambda head, device: None)
    want = run()
    tol = {"rtol": 2e-2, "atol": 2e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    for x, y in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(x, y, **tol)
    assert set(got[2]) == set(want[2]) and "lm_head.weight" in got[2]
    assert ("norm.weight" in got[2]) == (not norm_output)
    for name in got[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **tol, msg=name)
