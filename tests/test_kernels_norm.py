"""The row-wise RMSNorm kernel (headstart/kernels/norm.cpp) and the RMSNorm module's use of it: torch's
formula up to the square sum's order, a row's bits its own, inference only, and every norm of an engine's
models through it with greedy speculation still equal to greedy AR."""

import re

import pytest
import torch
from test_kernels import DTYPES
from test_spec import _prompts

from headstart.inference import Engine, SamplingParams
from headstart.inference.speculation import SpecConfig
from headstart.models.llama import load_llama
from headstart.nn.linear import cpu_kernels_restored
from headstart.nn.norm import RMSNorm


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [576, 1728, 64, 37])
def test_rms_norm_rows_values_and_row_invariance(kernels, dtype, d):
    """torch's formula up to the square sum's order (it moves the last bit of a few rows), and a row's bits its own
    whatever shares the call: alone, in any order, in a call big enough to split over threads."""
    g = torch.Generator().manual_seed(d)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    x = (torch.randn(600, d, generator=g) * torch.rand(600, 1, generator=g) * 8).to(dtype)
    y = kernels.rms_norm_rows(x, w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    ref = _torch_rms_norm(x, w, 1e-5)
    if dtype == torch.bfloat16:  # at most one bf16 step (2^-7 relative) apart, and nearly always equal
        assert ((y.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()
        assert (y != ref).float().mean() < 0.01
    else:
        torch.testing.assert_close(y, ref, rtol=2e-6, atol=1e-7)
    for i in (0, 1, 17, 599):
        assert torch.equal(kernels.rms_norm_rows(x[i:i + 1], w, 1e-5), y[i:i + 1])
    perm = torch.randperm(600, generator=g)
    assert torch.equal(kernels.rms_norm_rows(x[perm], w, 1e-5), y[perm])
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(kernels.rms_norm_rows(x, w, 1e-5), y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernels.rms_norm_rows(x.view(20, 30, d), w, 1e-5), y.view(20, 30, d))  # any leading shape
    assert torch.equal(kernels.rms_norm_rows(x.t().contiguous().t(), w, 1e-5), y)  # strided input


def test_rms_norm_rows_refuses_bad_input(kernels):
    w = torch.ones(8)
    for x, wt, what in [(torch.ones(2, 8, dtype=torch.bfloat16), w, "share a dtype"),
                        (torch.ones(2, 7), w, "weight (D)"), (torch.ones(2, 8), torch.ones(2, 4), "weight (D)"),
                        (torch.ones(2, 8, dtype=torch.float16), w.half(), "bf16 or fp32")]:
        with pytest.raises(RuntimeError, match=re.escape(what)):
            kernels.rms_norm_rows(x, wt, 1e-6)


@pytest.fixture
def norm_calls(kernels, monkeypatch):
    """The norm kernel as RMSNorm sees it, counting its calls (it still computes)."""
    import headstart.nn.norm as norm_module

    calls = []

    class Spy:
        def rms_norm_rows(self, *args):
            calls.append(args[0].shape)
            return kernels.rms_norm_rows(*args)

    monkeypatch.setattr(norm_module, "rowwise", lambda: Spy())
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_uses_the_kernel_only_for_inference(kernels, norm_calls, dtype):
    norm = RMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    assert norm.enable_cpu_kernels() == "rows"
    x = torch.randn(5, 48).to(dtype)
    with torch.inference_mode():
        assert torch.equal(norm(x), kernels.rms_norm_rows(x, norm.weight, 1e-5)) and len(norm_calls) == 1
    with torch.no_grad():  # no gradients recorded: the kernel too
        norm(x)
    assert len(norm_calls) == 2
    norm_calls.clear()
    xg = x.clone().requires_grad_()
    norm(xg).sum().backward()  # training: gradients for both
    assert xg.grad is not None and norm.weight.grad is not None
    norm.weight.grad = None
    norm(x).sum().backward()  # a norm over frozen inputs (fc_norm on target states): the weight learns
    assert norm.weight.grad is not None
    norm.weight.requires_grad_(False)
    xg.grad = None
    norm(xg).sum().backward()  # a frozen norm over the head's output (the target's final norm)
    assert xg.grad is not None
    norm.weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(norm(x), _torch_rms_norm(x, norm.weight, 1e-5))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with torch.inference_mode():  # another dtype than the weight's: torch's formula (promoted)
        assert norm(x.to(other)).dtype == torch.float32
    assert norm_calls == []  # none of those took the kernel
    with cpu_kernels_restored(norm):
        norm.disable_cpu_kernels()
        with torch.inference_mode():
            assert torch.equal(norm(x), _torch_rms_norm(x, norm.weight, 1e-5))
    assert norm._kernel and norm_calls == []  # restored, and the block ran torch's ops
    half = RMSNorm(48)
    assert half.enable_cpu_kernels() == "rows"
    half.half()  # the weight's dtype changes after the kernel was chosen
    with torch.inference_mode():  # a dtype the kernel does not compute: torch's formula, not an error
        assert half(torch.randn(3, 48).half()).dtype == torch.float16
    assert norm_calls == []
    assert norm.enable_cpu_kernels(rowwise_kernels=False) == "" and not norm._kernel


def test_an_engine_runs_every_norm_of_its_models_through_the_kernel(kernels, kernel_target_dir, norm_calls):
    """The target's norms and a chain head's (eagle3 with the EAGLE-3.1 norms) take the kernel in an
    engine, and greedy speculation still equals greedy AR."""
    target = load_llama(kernel_target_dir, "bf16")
    from headstart.heads import HeadConfig, build_head

    head = build_head(HeadConfig(head_type="eagle3", aux_layer_ids=[0, 1, 2], fc_norm=True,
                                 norm_before_residual=True, norm_output=True), target)
    spec = Engine(target, spec=SpecConfig(method="chain", k=2, head=head))
    norms = [m for model in (spec.model, spec.proposer.head) for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) > 8 and all(m._kernel for m in norms)
    prompts = _prompts(2, seed=5)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert len(norm_calls) > 0
    assert got == [o.token_ids for o in Engine(target).generate(prompts, params)]
