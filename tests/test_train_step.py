"""The training step built for GPUs (issue 32): TTT attention as one fused call per step over padded
sequences (against the looped reference, tests/ttt_reference.py), the teacher once per chunk for every
step, one host sync per micro-batch, train.compile."""

import contextlib
import json
from pathlib import Path

import pytest
import torch
from test_train_parts import _batch, deepseek_target, target  # noqa: F401 - module fixtures shared

from headstart.heads import HeadConfig, build_head, build_vocab_maps
from headstart.models.llama import load_llama
from headstart.nn.attention import packed_metadata
from headstart.train.losses import distill
from headstart.train.ttt import unroll

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("draft_vocab", [None, 96])
def test_the_teacher_runs_once_per_chunk_for_every_ttt_step(target, draft_vocab, monkeypatch):
    """With TTT 4 the target's lm_head runs once per row chunk in the forward pass and once in its
    recompute (once in all where the fused chunks take the gradient in the forward pass: eagle3's own
    draft lm_head on CPU), not once per step; the loss and its gradient are those of four separate distills."""
    import headstart.train.losses as losses
    from headstart.recipe_io import recipe_from_dict
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
    passes = 1 if draft_vocab else 2  # fused; else forward + recompute, whatever the step count
    assert len(calls) == passes * chunks, (len(calls), chunks)
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


@pytest.mark.parametrize("kind, rows", [(k, "all") for k in ("mtp", "eagle1", "eagle3", "deepseek_mtp", "medusa",
                                                               "draft_lm", "dflash")]
                         + [("eagle3", "reached"), ("mtp", "reached")])
def test_a_training_step_waits_for_the_device_once(target, deepseek_target, kind, rows, tmp_path):
    """The real training_step (Lightning, manual optimisation, TTT 3 / a dflash block) on micro-batches
    that are not logged, for every head family (deepseek_mtp on an MLA + MoE target): its one host sync is
    the non-finite check every rank agrees on. On CPU a tensor made from a host value with device=... looks
    like host data, so this sees syncs on computed values (a float(loss) per step, nonzero of a computed
    mask, and the ops whose CUDA kernels read back: headstart.train.syncs); the CUDA test below sees
    every one. train.ttt_rows: reached follows the greedy chain on the device (no read back either)."""
    import lightning as L

    from headstart.recipe_io import recipe_from_dict
    from headstart.train.module import HeadModule
    from headstart.train.syncs import DeviceSyncCounter

    extra = {"aux_layer_ids": [0, 1, 2]} if kind in ("eagle3", "dflash") else {}
    if kind == "dflash":
        extra["block_size"] = 4
    recipe = recipe_from_dict({"head": {"type": kind, **extra}, "logging": {"wandb": False, "every_steps": 100},
                               "train": {"ttt_steps": 3, "grad_accum": 2, "warmup_steps": 0, "max_steps": 2,
                                         "ttt_rows": rows}})
    model = deepseek_target if kind == "deepseek_mtp" else target
    head = build_head(HeadConfig(head_type=kind, **extra), model)
    module = HeadModule(recipe, model, head)
    batches = [_batch(model, lens=(21, 9, 30), seed=i) for i in range(4)]
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
@pytest.mark.parametrize("kind, rows", [(k, "all") for k in ("mtp", "eagle1", "eagle3", "deepseek_mtp", "medusa",
                                                               "draft_lm", "dflash")]
                         + [("eagle3", "reached"), ("mtp", "reached")])
def test_a_cuda_training_step_waits_for_the_device_once(tmp_path, kind, rows):
    """torch's own sync detector on a GPU: one warning per micro-batch (the non-finite check), every family
    (deepseek_mtp here on a Llama target: its block is then a Llama layer), and train.ttt_rows: reached."""
    import warnings

    import lightning as L
    from tiny_models import make_hf_model

    from headstart.recipe_io import recipe_from_dict
    from headstart.train.module import HeadModule

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    make_hf_model("llama", tmp_path / "m")
    target = load_llama(tmp_path / "m", "fp32").cuda()
    extra = {"aux_layer_ids": [0, 1, 2]} if kind in ("eagle3", "dflash") else {}
    if kind == "dflash":
        extra["block_size"] = 4
    recipe = recipe_from_dict({"head": {"type": kind, **extra}, "logging": {"wandb": False, "every_steps": 100},
                               "train": {"ttt_steps": 3, "warmup_steps": 0, "max_steps": 3, "ttt_rows": rows}})
    head = build_head(HeadConfig(head_type=kind, **extra), target)
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
    from headstart.recipe_io import recipe_from_dict
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

    from torch._dynamo.exc import BackendCompilerFailed

    def broken(fn, **kw):
        def fails(*a, **k):
            raise BackendCompilerFailed(broken, RuntimeError("no C++ compiler\nmore detail"), first_useful_frame=None)
        return fails

    monkeypatch.setattr(module_py.torch, "compile", broken)
    fallback = run(True)
    err = capsys.readouterr().err
    assert "train.compile: mtp.forward_hidden runs eagerly: it did not compile (BackendCompilerFailed: backend=" in err
    assert err.count("forward_hidden runs eagerly") == 1  # said once, not per step
    torch.testing.assert_close(fallback[0], eager[0], rtol=0, atol=0)


def test_an_error_of_the_compiled_call_is_raised_and_compile_stays_on(capsys):
    """Out of memory in the compiled call is raised at once; an error of the computation itself (a bad
    batch: under dynamo a TorchRuntimeError, which a real compile failure can be too) is told apart by
    the eager run of the same call failing as well: its error is raised, nothing says "did not compile",
    and the next call runs compiled again. Only a call that runs eagerly switches compile off."""
    from torch._dynamo.exc import TorchRuntimeError

    from headstart.train.module import Compiled

    calls = []

    def compiled(x):
        calls.append("compiled")
        if x == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if x in ("bad", "unsupported"):
            raise TorchRuntimeError("Dynamo failed to run FX node with fake tensors")
        return "ok"

    def eager(x):
        calls.append("eager")
        if x == "bad":
            raise ValueError("a bad batch")
        return "eager"

    c = Compiled(eager, "mtp.forward_hidden")
    c.compiled = compiled
    with pytest.raises(torch.OutOfMemoryError):
        c("oom")
    with pytest.raises(ValueError, match="a bad batch"):
        c("bad")
    assert c("fine") == "ok" and calls == ["compiled", "compiled", "eager", "compiled"]
    assert "did not compile" not in capsys.readouterr().err
    assert c("unsupported") == "eager" and c("fine") == "eager"  # compiled no more
    assert "mtp.forward_hidden runs eagerly: it did not compile (TorchRuntimeError" in capsys.readouterr().err


@pytest.mark.parametrize("merged", [True, False], ids=["cpu-merged", "masked"])
@pytest.mark.parametrize("kind", ["mtp", "eagle3", "deepseek_mtp"])
def test_batched_ttt_attention_equals_the_looped_one_with_its_gradient(target, deepseek_target, kind, merged,
                                                                        monkeypatch):
    """One attention call per unrolled step over all packed rows gives what the loop over sequences and
    query blocks gave (tests/ttt_reference.py), forward and backward, at fp32, on sequences of several
    lengths (a neighbour leaking in, or a key off by one row, shows): on CPU's merged steps (causal flash +
    diagonal keys) and on the masked steps CUDA runs."""
    from ttt_reference import use_looped

    from headstart.train.ttt import UnrolledAttention

    monkeypatch.setattr(UnrolledAttention, "merged_on_cpu", merged)

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
    """What autograd saves for the unrolled steps, in the forward and in the backward's recompute of each
    step: no per-head score tensor (B, H, L, keys), only the steps' 2-D masks, which the layers and
    sequences share; the same check on a plain softmax(q k^T) finds the scores."""
    import headstart.train.ttt as ttt

    head = build_head(HeadConfig(head_type="mtp"), target)
    b = _batch(target, lens=(101, 60))
    length = 100  # the longest shifted sequence

    def scores_saved():
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the backward's recompute too
            outs, _, _ = unroll(head, b, 3)
            sum(o.sum() for o in outs).backward()
        return [sh for sh in shapes if len(sh) >= 3 and min(sh[-2:]) >= length]

    assert scores_saved() == []

    def plain(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):  # keeps the probabilities
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        if attn_mask is None:
            n = q.shape[-2]
            attn_mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(q @ k.transpose(-1, -2) * scale + attn_mask, dim=-1) @ v

    monkeypatch.setattr(ttt.UnrolledAttention, "merged_on_cpu", False)
    assert scores_saved() == []  # the masked steps CUDA runs
    monkeypatch.setattr(ttt.F, "scaled_dot_product_attention", plain)
    assert scores_saved()


@pytest.mark.parametrize("merged", [True, False], ids=["cpu-merged", "masked"])
def test_ttt_attention_calls_do_not_grow_with_the_sequences(target, merged, monkeypatch):
    """The same 48 rows packed as 1, 4 or 12 sequences (one length bucket each) run the same aten ops (no
    loop over sequences): masked, each step's attention once forward and once in the backward's recompute;
    CPU's merged steps, one flash call forward and one flash backward per step (no recompute)."""
    from torch.profiler import profile

    from headstart.train.ttt import UnrolledAttention

    monkeypatch.setattr(UnrolledAttention, "merged_on_cpu", merged)
    head = build_head(HeadConfig(head_type="mtp"), target)
    names = ("aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward") if merged else \
        ("aten::scaled_dot_product_attention",)
    counts = []
    for lens in ((49,), (13, 13, 13, 13), (5,) * 12 + (1,)):
        b = _batch(target, lens=lens)
        with profile() as prof:
            outs, _, _ = unroll(head, b, 3)
            sum(o.sum() for o in outs).backward()
        counts.append(sum(e.count for e in prof.key_averages() if e.key in names))
    assert counts[0] == counts[1] == counts[2] == 2 * 3 * head.kv_layers(), counts


def test_the_loss_chunk_is_256_rows_on_cpu_and_what_fits_two_gib_on_a_gpu():
    """Each chunk is a forward, a recompute and a backward of the lm_head and the KL: on a GPU fewer,
    larger chunks are fewer launches; `headstart plan` counts the chunk the device will use."""
    from headstart.plan import make_plan
    from headstart.recipe_io import recipe_from_dict
    from headstart.sizing import loss_chunk_rows

    assert loss_chunk_rows(None, 32000, 7, "cpu", 16384) == 256
    assert loss_chunk_rows(None, 32000, 7, "cuda", 16384) == 1536  # 2 GiB / (10 x 32,000 x 4 B) = 1,677 rows
    assert loss_chunk_rows(None, 32000, 7, "cuda", 1000) == 1024  # never beyond the micro-batch (whole blocks)
    assert loss_chunk_rows(None, 128256, 7, "cuda", 4096) == 256  # at least one block
    assert loss_chunk_rows(64, 32000, 7, "cuda", 16384) == 64  # the recipe's own value wins
    cfg = json.loads((ROOT / "recipes/targets/llama-3.2-1b.json").read_text())
    recipe = recipe_from_dict({"head": {"type": "eagle3", "draft_vocab_size": 32000},
                               "train": {"ttt_steps": 7, "batch_tokens": 16384}})
    gpu = {t.name: t for p in make_plan(recipe, cfg).phases for t in p.terms}["chunked loss"]
    assert gpu.note.startswith("1,536 rows x 32,000 logits") and gpu.bytes == 10 * 1536 * 32000 * 4
    cpu = {t.name: t for p in make_plan(recipe, cfg, device="CPU RAM", capacity_gb=24).phases for t in p.terms}
    assert cpu["chunked loss"].note.startswith("256 rows")


def test_a_chain_heads_loss_chunk_on_a_gpu_is_the_one_plan_counts(target):  # noqa: F811
    """HeadModule picks the chunk by the batch's device and the TTT steps that share it (a meta-device batch
    stands for a GPU's here)."""
    from headstart.heads import PackedBatch
    from headstart.recipe_io import recipe_from_dict
    from headstart.sizing import loss_chunk_rows
    from headstart.train.module import HeadModule

    recipe = recipe_from_dict({"head": {"type": "mtp"}, "train": {"ttt_steps": 7, "batch_tokens": 262144}})
    head = build_head(HeadConfig(head_type="mtp"), target)
    module = HeadModule(recipe, target, head)
    vocab = target.config.vocab_size
    rows = 262144  # a tiny vocabulary: only a long micro-batch shows the chunk
    batch = PackedBatch(torch.zeros(rows, dtype=torch.long), [rows], torch.empty(rows, 8, device="meta"), None, None)
    assert module._loss_chunk(head, batch) == loss_chunk_rows(None, vocab, 7, "cuda", rows) != \
        loss_chunk_rows(None, vocab, 1, "cuda", rows)
    cpu = PackedBatch(batch.input_ids, [rows], torch.empty(rows, 8), None, None)
    assert module._loss_chunk(head, cpu) == 256


def test_the_sync_counter_flags_the_ops_whose_cuda_kernels_read_back():
    """On device-derived tensors: bincount, a boolean-mask index, repeat_interleave without output_size,
    unique, masked_select, equal and a scalar read are counted; an integer index, repeat_interleave with
    output_size and host-side work are not."""
    from headstart.train.syncs import DeviceSyncCounter

    x = torch.randn(10)
    counter = DeviceSyncCounter([x])
    with counter:
        y = x * 2
        torch.bincount((y > 0).long())
        _ = y[y > 0]
        torch.repeat_interleave(torch.arange(3), (y[:3] > -99).long())
        torch.unique(y)
        y.masked_select(y > 0)
        torch.equal(y, y)
        float(y.sum())
        _ = y[torch.tensor([1, 2])]
        torch.repeat_interleave(torch.arange(3), (y[:3] > -99).long(), output_size=3)
        torch.bincount(torch.tensor([1, 2, 2]))  # host data
    assert counter.syncs == ["aten.bincount.default", "aten.index.Tensor", "aten.repeat_interleave.Tensor",
                             "aten._unique2.default", "aten.masked_select.default", "aten.equal.default",
                             "aten._local_scalar_dense.default"], counter.syncs


def _merged_and_masked(j, leaves, grad, autocast):
    """[output, gradient of each input] of ttt_cpu.MergedStep and of SDPA with step j's mask (plain autograd)."""
    from headstart.train.ttt import UnrolledAttention, _step_attention
    from headstart.train.ttt_cpu import MergedStep

    n = leaves[0].shape[1]
    mask = None if j == 0 else UnrolledAttention().mask(j, n, torch.bfloat16 if autocast else torch.float32,
                                                       torch.device("cpu"))
    results = []
    for merged in (True, False):
        xs = [t.clone().requires_grad_() for t in leaves]
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            ys = [x.to(torch.bfloat16) for x in xs] if autocast else xs  # what autocast's linears hand on
            out = MergedStep.apply(ys[0], j, 0.3, *ys[1:]) if merged else _step_attention(ys[0], tuple(ys[1:]), mask,
                                                                                           j, 0.3)
        out.float().backward(grad)
        results.append([out.float(), *(x.grad for x in xs)])
    return results


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_cpu_merged_step_equals_the_masked_step_with_its_gradients(autocast):
    """ttt_cpu.MergedStep (causal flash over step-0 keys merged with the diagonal keys by log-sum-exp; the
    flash backward given the merged output and log-sum-exp) against SDPA with step j's mask through plain
    autograd: outputs and every input's gradient, steps 0-3, grouped and plain heads, rows shorter than j
    (no step-0 key at all), one row."""
    g = torch.Generator().manual_seed(0)
    tol = {"rtol": 2e-2, "atol": 4e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    for j in range(4):
        for b, n, hq, hkv, d in ((2, 9, 6, 2, 8), (1, 3, 4, 4, 16), (3, 1, 2, 1, 4), (2, 40, 4, 2, 8)):
            leaves = [torch.randn(b, n, hq, d, generator=g)] + [torch.randn(b, n, hkv, d, generator=g)
                                                               for _ in range(2 * (j + 1))]
            got, want = _merged_and_masked(j, leaves, torch.randn(b, n, hq, d, generator=g), autocast)
            for i, (x, y) in enumerate(zip(got, want)):
                torch.testing.assert_close(x, y, **tol, msg=f"j={j} n={n} hq={hq}: tensor {i} differs")


def test_cpu_ttt_attention_runs_the_merged_steps_by_default(target):
    """Without the tests' switch, CPU's unrolled steps are ttt_cpu.MergedStep (what plan's CPU terms count)."""
    from torch.profiler import profile

    head = build_head(HeadConfig(head_type="mtp"), target)
    b = _batch(target, lens=(9, 4))
    with profile() as prof:
        outs, _, _ = unroll(head, b, 3)
        sum(o.sum() for o in outs).backward()
    keys = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in keys
    assert "aten::scaled_dot_product_attention" not in keys
