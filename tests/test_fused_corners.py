"""train.losses.FusedChunks (CPU, eagle3's own draft lm_head) against the checkpointed chunks in corner cases: no
supervised row at all, a step with none, a scaled upstream gradient and a second backward, a draft vocabulary
as large as the target's, held-out (no_grad) numbers, and under FSDP2, where the losses run inside the root's
forward on the unsharded weight."""

from __future__ import annotations

import copy
import socket

import pytest
import test_train_parts as parts
import torch
from test_losses_lk import _draft_vocab_head

import headstart.train.losses as fused
from headstart.heads import HeadConfig, build_head
from headstart.train.losses import distill_steps, objective

target, _batch = parts.target, parts._batch
LOSSES = ["kl", "lk_lambda", "lk_alpha"]
ROWS = [torch.tensor([0, 3, 4, 9, 10, 20, 30, 31]), torch.tensor([1, 3, 9, 12, 13, 20, 28])]


def _states(b, k=2):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(b.input_ids.numel(), 64, generator=g) * 2 for _ in range(k)]


def _run(head, b, states, rows, loss, with_stats, scale=1.0, twice=False):
    head.zero_grad(set_to_none=True)
    hh = [s.clone().requires_grad_() for s in states]
    ps = distill_steps(head, hh, b.hidden, rows, None, chunk=5, with_stats=with_stats, lk=loss != "kl")
    total = sum(0.8 ** j * objective(p, loss) for j, p in enumerate(ps)) * scale
    total.backward(retain_graph=twice)
    if twice:
        total.backward()
    sums = [torch.stack([p.kl, p.alpha, p.neglog_alpha, p.correct, p.accept, p.mass]).detach() for p in ps]
    return sums, [h.grad for h in hh], {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


def _compare(monkeypatch, head, b, states, rows, loss, with_stats=True, **kw):
    calls = []
    real = fused.FusedChunks.apply
    with monkeypatch.context() as m:
        m.setattr(fused.FusedChunks, "apply", lambda *a: calls.append(1) or real(*a))
        got = _run(head, b, states, rows, loss, with_stats, **kw)
    assert calls, "the fused path did not run"
    with monkeypatch.context() as m:
        m.setattr(fused, "fused_projection", lambda head, device: None)
        want = _run(head, b, states, rows, loss, with_stats, **kw)
    for x, y in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert set(got[2]) == set(want[2]) and "lm_head.weight" in got[2]
    for n in got[2]:
        torch.testing.assert_close(got[2][n], want[2][n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("with_stats", [True, False])
@pytest.mark.parametrize("loss", LOSSES)
def test_no_supervised_row_and_a_step_without_rows(target, monkeypatch, loss, with_stats):
    head, _ = _draft_vocab_head(target)
    b = _batch(target)
    none = torch.zeros(0, dtype=torch.long)
    _compare(monkeypatch, head, b, _states(b), [none, none], loss, with_stats)  # lm_head still gets a (zero) grad
    _compare(monkeypatch, head, b, _states(b, 3), [torch.tensor([0, 1, 2, 3, 4, 20, 21]), none,
                                                   torch.tensor([20, 21, 30])], loss, with_stats)


@pytest.mark.parametrize("loss", LOSSES)
def test_a_scaled_upstream_gradient_and_a_second_backward(target, monkeypatch, loss):
    head, _ = _draft_vocab_head(target)
    b = _batch(target)
    _compare(monkeypatch, head, b, _states(b), ROWS, loss, False, scale=0.25, twice=True)


@pytest.mark.parametrize("loss", LOSSES)
def test_a_draft_vocabulary_of_the_whole_vocabulary(target, monkeypatch, loss):
    head = build_head(HeadConfig(head_type="eagle3", aux_layer_ids=[0, 1, 2], draft_vocab_size=512), target)
    b = _batch(target)
    _compare(monkeypatch, head, b, _states(b), ROWS, loss)
    full = build_head(HeadConfig(head_type="eagle3", aux_layer_ids=[0, 1, 2]), target)  # the target's lm_head
    assert fused.fused_projection(full, torch.device("cpu")) is None


@pytest.mark.parametrize("loss", LOSSES)
def test_held_out_numbers_take_the_checkpointed_path_and_equal_the_fused_ones(target, monkeypatch, loss):
    head, _ = _draft_vocab_head(target)
    b = _batch(target)
    calls = []
    real = fused.FusedChunks.apply
    monkeypatch.setattr(fused.FusedChunks, "apply", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        held = distill_steps(head, _states(b), b.hidden, ROWS, None, chunk=5, with_stats=True, lk=loss != "kl")
    assert not calls
    train = distill_steps(head, [s.requires_grad_() for s in _states(b)], b.hidden, ROWS, None, chunk=5,
                          with_stats=True, lk=loss != "kl")
    assert calls
    for p, q in zip(held, train):
        for f in ("kl", "alpha", "neglog_alpha", "correct", "accept", "mass"):
            torch.testing.assert_close(getattr(p, f), getattr(q, f).detach(), rtol=1e-5, atol=1e-6)


def test_under_fsdp2_the_fused_path_runs_on_the_unsharded_weight(target, monkeypatch):
    """As module.HeadStep: fully_shard'ed root, the losses inside its forward. The lm_head weight there is
    the unsharded plain parameter, so the fused path runs; the sharded gradients equal the unsharded
    checkpointed ones (one gloo rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        head, _ = _draft_vocab_head(target)
        head.config.norm_output = False  # the norm's gradient through `pre` too
        ref = copy.deepcopy(head)
        b = _batch(target)

        class Root(torch.nn.Module):
            def __init__(self, head):
                super().__init__()
                self.head = head

            def forward(self, hh):
                ps = distill_steps(self.head, hh, b.hidden, ROWS, None, chunk=5, with_stats=False, lk=True)
                return sum(0.8 ** j * objective(p, "lk_lambda") for j, p in enumerate(ps))

        root = Root(head)
        fully_shard(root, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=False)
        calls = []
        real = fused.FusedChunks.apply
        with monkeypatch.context() as m:
            m.setattr(fused.FusedChunks, "apply", lambda *a: calls.append(1) or real(*a))
            root([s.requires_grad_() for s in _states(b)]).backward()
        assert calls, "the fused path did not run under FSDP2"
        with monkeypatch.context() as m:
            m.setattr(fused, "fused_projection", lambda head, device: None)
            Root(ref)([s.requires_grad_() for s in _states(b)]).backward()
        want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert "lm_head.weight" in want and "norm.weight" in want
        for n, p in root.head.named_parameters():
            if n in want:
                torch.testing.assert_close(p.grad.full_tensor(), want[n], rtol=1e-5, atol=1e-6, msg=n)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kept,loss", [((0, 1), "lk_alpha"), ((2,), "lk_lambda"), ((0,), "lk_lambda")])
def test_a_loss_that_needs_a_dropped_gradient_is_refused(target, kept, loss):
    """The trainer keeps only its objective's gradients in the fused chunks (grad_components); a backward that reaches
    another component raises instead of returning a gradient without it."""
    head, _ = _draft_vocab_head(target)
    b = _batch(target)
    hh = [s.clone().requires_grad_() for s in _states(b)]
    ps = distill_steps(head, hh, b.hidden, ROWS, None, chunk=5, with_stats=False, lk=True, grads=kept)
    total = sum(objective(p, loss) for p in ps)
    with pytest.raises(RuntimeError, match="kept the gradients of components"):
        total.backward()


def test_the_trainer_keeps_each_objectives_gradients():
    from headstart.sizing import grad_components

    assert grad_components("kl") == (0,) and grad_components("lk_alpha") == (2,)
    assert grad_components("lk") == grad_components("lk_lambda") == (0, 1)


def test_a_dropped_gradient_reached_at_a_later_step_only_and_grads_without_lk_are_refused(target):
    head, _ = _draft_vocab_head(target)
    b = _batch(target)
    hh = [s.clone().requires_grad_() for s in _states(b)]
    ps = distill_steps(head, hh, b.hidden, ROWS, None, chunk=5, with_stats=False, lk=True, grads=(2,))
    with pytest.raises(RuntimeError, match="kept the gradients of components"):
        (objective(ps[1], "lk_lambda") + objective(ps[0], "lk_alpha")).backward()
    with pytest.raises(ValueError, match="need lk"):
        distill_steps(head, hh, b.hidden, ROWS, None, chunk=5, with_stats=False, lk=False, grads=(0, 1))


@pytest.mark.parametrize("case", ["plain", "ttt3_feature", "no_rows", "bf16"])
@pytest.mark.parametrize("loss", ["kl", "lk", "lk_alpha"])
def test_the_trainer_takes_the_fused_path_with_its_objectives_gradients(target, monkeypatch, loss, case):
    """HeadModule.losses on an eagle3 head with its own draft lm_head: the fused chunks run with the components
    sizing.grad_components(train.loss) names, and the loss and every gradient equal the checkpointed path's."""
    from headstart.recipe_io import recipe_from_dict
    from headstart.sizing import grad_components
    from headstart.train.module import HeadModule

    train = {"ttt_steps": 3, "ttt_decay": 0.5, "loss_weights": {"kl": 0.7, "feature": 0.3}, "lk_kl_scale": 0.6,
             "lk_kl_decay": 1.5} if case == "ttt3_feature" else {"ttt_steps": 2}
    head, _ = _draft_vocab_head(target)
    module = HeadModule(recipe_from_dict({"train": {**train, "loss": loss}, "head": {"type": "eagle3"}}), target, head)
    b = _batch(target)
    if case == "no_rows":
        b.loss_mask.zero_()

    def run():
        head.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16"):
            total, _ = module.losses(b, with_stats=True)
        total.backward()
        return total.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    seen = []
    real = fused.FusedChunks.apply
    with monkeypatch.context() as m:
        m.setattr(fused.FusedChunks, "apply", lambda *a: seen.append(a[8]) or real(*a))
        got = run()
    assert seen == [grad_components(loss)]
    with monkeypatch.context() as m:
        m.setattr(fused, "fused_projection", lambda head, device: None)
        want = run()
    tol = {"rtol": 2e-2, "atol": 2e-3} if case == "bf16" else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got[0], want[0], **tol)
    assert set(got[1]) == set(want[1]) and "lm_head.weight" in got[1]
    for n in got[1]:
        torch.testing.assert_close(got[1][n], want[1][n], **tol, msg=n)
