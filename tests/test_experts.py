"""The stacked routed experts (headstart.nn.experts): the grouped forward equals one matmul per expert (the
implementation before the experts were stacked) in outputs and gradients at fp32, with no host sync in
training; the engine's row-invariant per-expert path equals it too; checkpoints with one tensor per expert
load into the stacked weights (and a missing or extra expert is named); state dicts saved before the
stacking still load; the export unstacks and the import stacks back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from headstart.errors import AssetError
from headstart.export.layout import stack_experts, unstack_experts
from headstart.models.deepseek import DeepseekConfig, MoE
from headstart.models.loading import load_weights
from headstart.nn.experts import RoutedExperts, grouped_mm_runs
from headstart.nn.linear import enable_cpu_kernels

E, D, H, K = 8, 32, 24, 2


def _experts(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return RoutedExperts(E, D, H, F.silu).to(dtype)


def _routing(n, seed=1, skip=(5,)):
    """Each token's K distinct experts (never those in `skip`: an idle expert) and their weights."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(n)])
    return torch.rand(n, K, generator=g), ids


def _per_expert_reference(m: RoutedExperts, x, weights, ids):
    """One matmul per expert, rows added back in expert order: the MoE forward before the stacking."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    tokens, w = order // K, weights.flatten()[order]
    out, start = torch.zeros_like(x), 0
    for e, count in enumerate(counts):
        rows = tokens[start:start + count]
        gate, up = F.linear(x[rows], m.gate_up_proj.weight[e]).split(H, dim=-1)
        y = F.linear(F.silu(gate) * up, m.down_proj.weight[e]) * w[start:start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


@pytest.mark.parametrize("n", [1, 7, 40])
def test_grouped_experts_equal_one_matmul_per_expert_outputs_and_gradients(n):
    assert grouped_mm_runs(torch.zeros(1))
    m = _experts()
    weights, ids = _routing(n)
    x = torch.randn(n, D, requires_grad=True)
    got = m(x, weights, ids)
    gx, ggu, gd = torch.autograd.grad(got.square().sum(), [x, m.gate_up_proj.weight, m.down_proj.weight])
    want = _per_expert_reference(m, x, weights, ids)
    wx, wgu, wd = torch.autograd.grad(want.square().sum(), [x, m.gate_up_proj.weight, m.down_proj.weight])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ggu, wgu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gd, wd, rtol=1e-5, atol=1e-6)
    # The idle expert is in the graph (every rank reduces every weight) and gets a zero gradient.
    assert ggu[5].abs().sum() == 0 and gd[5].abs().sum() == 0 and ggu[ids[0, 0]].abs().sum() > 0


def test_the_grouped_training_forward_and_backward_wait_on_no_host_sync(monkeypatch):
    """No scalar read or data-dependent shape (headstart.train.syncs), and no `tolist` of the group sizes
    (which does not dispatch on CPU: counted by patching it)."""
    from headstart.train.syncs import DeviceSyncCounter

    lists = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: lists.append(t.shape) or real(t))
    m = _experts()
    weights, ids = _routing(16)
    x = torch.randn(16, D, requires_grad=True)
    counter = DeviceSyncCounter([*m.parameters(), x, weights, ids])
    with counter:
        m(x, weights, ids).square().sum().backward()
    assert counter.syncs == [] and lists == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_per_expert_kernels_equal_the_grouped_form_and_are_row_invariant(dtype):
    """With the CPU kernels on (the engine), every token's output has the same bits alone as in a batch."""
    m = _experts(dtype=dtype)
    weights, ids = _routing(6)
    x = torch.randn(6, D).to(dtype)
    with torch.no_grad():
        grouped = m(x, weights, ids)
        got = enable_cpu_kernels(m, rowwise_kernels=True, max_rows=None)
        assert len(got) == 2 * E
        batch = m(x, weights, ids)
        alone = torch.cat([m(x[i:i + 1], weights[i:i + 1], ids[i:i + 1]) for i in range(6)])
    if "rows" in got:
        assert torch.equal(batch, alone)
    torch.testing.assert_close(batch.float(), grouped.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    # A changed weight is read anew, not from the kernels' stale copy: in place (an optimizer step) or replaced
    # (a load through .data, which the per-expert views would not see).
    with torch.no_grad():
        m.down_proj.weight.mul_(2)
        torch.testing.assert_close(m(x, weights, ids).float(), 2 * batch.float(), rtol=2e-2, atol=1e-2)
        m.down_proj.weight.data = m.down_proj.weight.data * 2
        torch.testing.assert_close(m(x, weights, ids).float(), 4 * batch.float(), rtol=2e-2, atol=2e-2)


def test_with_the_cpu_kernels_on_training_still_reaches_the_expert_weights():
    """The kernels' copies are for no-grad forwards only: a training forward after a validation (which
    enabled them) must give the stacked weights their gradient."""
    m = _experts()
    weights, ids = _routing(6)
    enable_cpu_kernels(m, rowwise_kernels=True, max_rows=None)
    m(torch.randn(6, D), weights, ids).square().sum().backward()
    assert m.gate_up_proj.weight.grad is not None and m.gate_up_proj.weight.grad.abs().sum() > 0


def test_a_token_sums_its_experts_in_expert_order_bit_for_bit():
    """With three or more experts per token the order of the sum shows in the bits: the grouped form adds
    them in expert order, as the per-expert form (and the engine) does."""
    torch.manual_seed(3)
    m = RoutedExperts(E, D, H, F.silu)
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(32)])
    weights = torch.rand(32, 4, generator=g)
    x = torch.randn(32, D)
    with torch.no_grad():
        got = m(x, weights, ids)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        tokens, w = order // 4, weights.flatten()[order]
        want, start = torch.zeros_like(x), 0
        for e, count in enumerate(torch.bincount(flat, minlength=E).tolist()):
            rows = tokens[start:start + count]
            gate, up = F.linear(x[rows], m.gate_up_proj.weight[e]).split(H, dim=-1)
            want.index_add_(0, rows, F.linear(F.silu(gate) * up, m.down_proj.weight[e]) * w[start:start + count, None])
            start += count
    assert torch.equal(got, want)


def _moe_cfg():
    return DeepseekConfig(model_type="deepseek_v2", vocab_size=16, hidden_size=D, intermediate_size=48,
                          moe_intermediate_size=H, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=None,
                          kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rms_norm_eps=1e-6,
                          max_position_embeddings=64, n_routed_experts=E, num_experts_per_tok=K,
                          n_shared_experts=1, first_k_dense_replace=1)


def _per_expert_checkpoint(moe: MoE, prefix="model.layers.1.mlp."):
    """The MoE's weights as HF names them: gate / up / down apart, one tensor per expert."""
    state = {f"{prefix}gate.weight": moe.gate.weight.detach().clone()}
    for name, t in unstack_experts({f"{prefix}experts.gate_up_proj.weight": moe.experts.gate_up_proj.weight,
                                    f"{prefix}experts.down_proj.weight": moe.experts.down_proj.weight}).items():
        if ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            state[name.replace("gate_up_proj", "gate_proj")], state[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            state[name] = t
    for name, t in moe.shared_experts.state_dict().items():
        if "gate_up_proj" in name:
            gate, up = t.chunk(2)
            state[f"{prefix}shared_experts.{name.replace('gate_up_proj', 'gate_proj')}"] = gate.clone()
            state[f"{prefix}shared_experts.{name.replace('gate_up_proj', 'up_proj')}"] = up.clone()
        else:
            state[f"{prefix}shared_experts.{name}"] = t.clone()
    return state


class _Holder(torch.nn.Module):
    """`model.layers.1.mlp` = a MoE, as in a DeepSeek target."""

    def __init__(self, moe):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Module()])
        self.model.layers[1].mlp = moe


def _load(state, tmp_path):
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    torch.manual_seed(9)
    fresh = _Holder(MoE(_moe_cfg()))
    packed = {"gate_proj": ("gate_up_proj", 0, [-1, -1]), "up_proj": ("gate_up_proj", 1, [-1, -1])}
    load_weights(fresh, tmp_path, packed)
    return fresh.model.layers[1].mlp


def test_a_checkpoint_with_one_tensor_per_expert_loads_into_the_stacked_weights(tmp_path):
    torch.manual_seed(0)
    moe = MoE(_moe_cfg())
    loaded = _load(_per_expert_checkpoint(moe), tmp_path)
    for a, b in zip(moe.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)


def test_a_missing_or_extra_expert_is_named(tmp_path):
    torch.manual_seed(0)
    moe = MoE(_moe_cfg())
    state = _per_expert_checkpoint(moe)
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(AssetError, match="experts.gate_up_proj.weight"):
        _load(state, tmp_path)
    state = _per_expert_checkpoint(moe)
    state["model.layers.1.mlp.experts.8.down_proj.weight"] = torch.zeros(D, H)
    with pytest.raises(AssetError, match="names expert 8; the model has 8"):
        _load(state, tmp_path)


def test_a_state_dict_saved_with_one_module_per_expert_still_loads():
    torch.manual_seed(0)
    moe = MoE(_moe_cfg())
    old = {k: v for k, v in moe.state_dict().items() if ".experts." not in f".{k}"}
    for proj in ("gate_up_proj", "down_proj"):
        for e, w in enumerate(getattr(moe.experts, proj).weight.detach()):
            old[f"experts.{e}.{proj}.weight"] = w.clone()
    fresh = MoE(_moe_cfg())
    fresh.load_state_dict(old)
    assert torch.equal(fresh.experts.gate_up_proj.weight, moe.experts.gate_up_proj.weight)


def test_unstack_and_stack_are_inverse_and_a_gap_is_named():
    state = {"l.mlp.experts.gate_up_proj.weight": torch.randn(E, 2 * H, D), "l.other.weight": torch.randn(3)}
    flat = unstack_experts(state)
    assert "l.mlp.experts.7.gate_up_proj.weight" in flat and "l.mlp.experts.gate_up_proj.weight" not in flat
    back = stack_experts(flat)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    del flat["l.mlp.experts.2.gate_up_proj.weight"]
    with pytest.raises(AssetError, match=r"experts \[2\] are missing"):
        stack_experts(flat)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_on_cuda_equal_one_matmul_per_expert():
    m = _experts().cuda().to(torch.bfloat16)
    weights, ids = _routing(64)
    x = torch.randn(64, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights, ids = weights.cuda(), ids.cuda()
    got = m(x, weights, ids)
    got.float().square().sum().backward()
    want = _per_expert_reference(m, x.detach(), weights, ids)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert m.gate_up_proj.weight.grad is not None


def test_under_autocast_the_grouped_matmuls_take_autocasts_dtype(monkeypatch):
    """bf16-mixed training with fp32 master weights (DDP) and fp32 activations: the grouped matmuls get
    bf16 operands, as autocast gives F.linear (on CUDA an fp32 _grouped_mm does not run and the experts
    fell back to the per-expert loop with its host read), and the result is autocast's per-expert one."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, **kw: calls.append((a.dtype, b.dtype)) or real(a, b, **kw))
    m = _experts()
    weights, ids = _routing(12)
    x = torch.randn(12, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(x, weights, ids)
        want = _per_expert_reference(m, x, weights, ids)
    assert calls == [(torch.bfloat16, torch.bfloat16)] * 2 and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    got.square().sum().backward()
    assert m.gate_up_proj.weight.grad.dtype == torch.float32 and m.gate_up_proj.weight.grad.abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp32_master_weights_under_autocast_on_cuda_take_the_grouped_path_without_a_sync():
    if not grouped_mm_runs(torch.zeros(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("_grouped_mm needs sm90+")
    m = _experts().cuda()  # fp32 weights, as DDP's master copy
    weights, ids = (t.cuda() for t in _routing(64))
    x = torch.randn(64, D, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x, weights, ids)
        y.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert m.down_proj.weight.grad is not None
