"""The torch backend against a naive reference: paged gather, bottom-right causal, custom masks."""

import pytest
import torch

from headstart.inference.backends import TorchAttention, make_backend
from headstart.nn.attention import AttentionMetadata


def _setup(q_lens, kv_lens, page_size=3, hq=4, hkv=2, d=8, masks=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_pages = 256
    kc = torch.zeros(num_pages, page_size, hkv, d)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_pages, generator=g).tolist()  # pages scattered on purpose
    tables, slots, positions, full_k, full_v = [], [], [], [], []
    for q, kv in zip(q_lens, kv_lens):
        n_pages = -(-kv // page_size)
        table = [perm.pop() for _ in range(n_pages)]
        tables.append(table)
        k_all, v_all = torch.randn(kv, hkv, d, generator=g), torch.randn(kv, hkv, d, generator=g)
        full_k.append(k_all)
        full_v.append(v_all)
        for p in range(kv):  # the cached prefix is already in the pages
            kc[table[p // page_size], p % page_size] = k_all[p]
            vc[table[p // page_size], p % page_size] = v_all[p]
        for p in range(kv - q, kv):
            slots.append(table[p // page_size] * page_size + p % page_size)
            positions.append(p)
    width = max(len(t) for t in tables)
    pt = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        pt[b, : len(t)] = torch.tensor(t)
    indptr = torch.tensor([0] + q_lens).cumsum(0).int()
    meta = AttentionMetadata(
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots), qo_indptr=indptr,
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32), page_table=pt, page_size=page_size,
        q_lens_cpu=list(q_lens), kv_lens_cpu=list(kv_lens), custom_masks=masks,
    )
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    new_k = torch.cat([k[-ql:] for k, ql in zip(full_k, q_lens)])
    new_v = torch.cat([v[-ql:] for v, ql in zip(full_v, q_lens)])
    return meta, q, new_k, new_v, (kc, vc), full_k, full_v


def _reference(q, full_k, full_v, q_lens, kv_lens, masks, scale):
    outs, start = [], 0
    for b, (ql, kv) in enumerate(zip(q_lens, kv_lens)):
        qb = q[start:start + ql]  # (q, Hq, d)
        rep = qb.shape[1] // full_k[b].shape[1]
        k = full_k[b].repeat_interleave(rep, dim=1)
        v = full_v[b].repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if masks is not None and masks[b] is not None:
            allowed = masks[b]
        else:
            allowed = torch.arange(kv).unsqueeze(0) <= (torch.arange(ql).unsqueeze(1) + kv - ql)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += ql
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("q_lens", "kv_lens"),
    [([7], [7]), ([1], [9]), ([1, 1, 1], [4, 11, 1]), ([5, 1, 3], [5, 8, 12]), ([4], [10]), ([2, 6], [2, 6])],
    ids=["prefill", "decode", "decode-batch", "mixed", "chunk", "prefill-batch"],
)
def test_torch_backend_matches_reference(q_lens, kv_lens):
    meta, q, k, v, cache, full_k, full_v = _setup(q_lens, kv_lens)
    be = TorchAttention()
    be.plan(meta, 4, 2, 8, torch.float32)
    out = be.forward(q, k, v, cache, meta, scale=8**-0.5)
    ref = _reference(q, full_k, full_v, q_lens, kv_lens, None, 8**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_custom_tree_mask():
    # Sequence 0: 4 tree nodes over a 6-token prefix; node i sees the prefix and its ancestors.
    parents = [-1, 0, 0, 1]
    prefix, q0 = 6, 4
    m = torch.zeros(q0, prefix + q0, dtype=torch.bool)
    m[:, :prefix] = True
    for i, _ in enumerate(parents):
        j = i
        while j >= 0:
            m[i, prefix + j] = True
            j = parents[j]
    masks = [m, None]  # sequence 1 keeps the causal mask
    q_lens, kv_lens = [q0, 3], [prefix + q0, 9]
    meta, q, k, v, cache, full_k, full_v = _setup(q_lens, kv_lens, masks=masks, seed=3)
    be = TorchAttention()
    be.plan(meta, 4, 2, 8, torch.float32)
    out = be.forward(q, k, v, cache, meta, scale=0.3)
    torch.testing.assert_close(out, _reference(q, full_k, full_v, q_lens, kv_lens, masks, 0.3), rtol=1e-5, atol=1e-5)


def test_backend_choice():
    assert make_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_backend("flashinfer", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("xformers", torch.device("cpu"))


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """A Llama of head_dim 64 (a FlashInfer size), one of head_dim 16, and a DeepSeek (MLA) target."""
    from test_deepseek import CONFIGS, _hf_model
    from tiny_models import make_hf_model

    from headstart.models import load_target

    dirs = {name: tmp_path_factory.mktemp(name) for name in ("llama64", "llama16", "deepseek")}
    make_hf_model("llama", dirs["llama64"], hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    make_hf_model("llama", dirs["llama16"])
    kind, overrides = CONFIGS["v2-lite"]
    _hf_model(kind, overrides).save_pretrained(dirs["deepseek"])
    return {name: load_target(d, "fp32") for name, d in dirs.items()}


def test_one_rule_chooses_the_backend_for_the_device_and_the_target(targets, monkeypatch):
    """auto: FlashInfer on CUDA where it is installed and takes the target's attention, torch otherwise
    (DeepSeek's MLA latent cache, a head_dim its kernels lack, no FlashInfer, any CPU). An explicit
    flashinfer the target cannot use is refused, naming why, instead of failing at the first forward."""
    from headstart.inference import backends

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(backends, "flashinfer_installed", lambda: True)
    assert backends.choose_backend("auto", cuda, targets["llama64"]) == "flashinfer"
    assert backends.choose_backend("auto", cuda, targets["llama16"]) == "torch"
    assert backends.choose_backend("auto", cuda, targets["deepseek"]) == "torch"
    for model in targets.values():
        assert backends.choose_backend("auto", cpu, model) == "torch"
        assert backends.choose_backend("torch", cuda, model) == "torch"
    with pytest.raises(ValueError, match="MLA over a 24-wide latent cache"):
        backends.choose_backend("flashinfer", cuda, targets["deepseek"])
    with pytest.raises(ValueError, match="head_dim 16 is not one"):
        backends.choose_backend("flashinfer", cuda, targets["llama16"])
    assert backends.choose_backend("flashinfer", cuda, targets["llama64"]) == "flashinfer"
    monkeypatch.setattr(backends, "flashinfer_installed", lambda: False)
    assert backends.choose_backend("auto", cuda, targets["llama64"]) == "torch"


def test_every_verb_takes_engine_backend_from_the_recipe(targets, tmp_path, chat_model_dir, monkeypatch, capsys):
    """engine.backend reaches precompute, training (its validation engine), eval and regenerate, which build
    their engines through the rule above: flashinfer on this CPU is refused by each before any long work,
    naming the key; a value outside auto / torch / flashinfer is refused when the recipe is read."""
    from headstart.cli import main
    from headstart.errors import ConfigError
    from headstart.evaluate import EvalPlan, _engine
    from headstart.inference import backends
    from headstart.recipe_io import recipe_from_dict

    with pytest.raises(ConfigError, match="engine.backend"):
        recipe_from_dict({"engine": {"backend": "xformers"}})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\ntarget:\n  model: {chat_model_dir}\n  dtype: fp32\n"
                      "data:\n  source: sharegpt\n  limit: 8\nengine:\n  backend: flashinfer\n"
                      "train:\n  max_steps: 1\n  batch_tokens: 512\ntrainer:\n  accelerator: cpu\n"
                      "logging:\n  wandb: false\n")
    from headstart.heads import HeadConfig, build_head, save_head
    from headstart.models import load_target

    head = save_head(build_head(HeadConfig(head_type="mtp"), load_target(chat_model_dir, "fp32")), tmp_path / "h")
    for verb in (["precompute"], ["train"], ["eval", "--head", str(head)], ["regenerate"]):
        assert main([verb[0], str(recipe), *verb[1:]]) == 2, verb
        assert "engine.backend flashinfer: the flashinfer backend needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not list((tmp_path / "run").rglob("*.partial"))  # regenerate refused before it wrote anything
    seen = []
    real = backends.choose_backend
    monkeypatch.setattr(backends, "choose_backend", lambda name, *a, **k: seen.append(name) or real("torch", *a, **k))
    _engine(targets["llama16"], None, [[1, 2, 3]], EvalPlan(heads=[], backend="flashinfer"), None)
    assert seen == ["flashinfer"]


@pytest.mark.cuda
@pytest.mark.parametrize(("q_lens", "kv_lens"), [([1, 1, 1], [4, 11, 1]), ([5, 1, 3], [5, 8, 12])])
def test_flashinfer_matches_torch(q_lens, kv_lens):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    meta, q, k, v, (kc, vc), _, _ = _setup(q_lens, kv_lens, hq=8, hkv=2, d=128, page_size=16)

    def to(meta, dtype):
        import dataclasses

        return dataclasses.replace(
            meta, positions=meta.positions.to(dev), slot_mapping=meta.slot_mapping.to(dev),
            qo_indptr=meta.qo_indptr.to(dev), kv_lens=meta.kv_lens.to(dev), page_table=meta.page_table.to(dev),
            backend_state={},
        )

    for scale in (128**-0.5, 0.05):  # the model's own scale, and another one (must not be ignored)
        outs = []
        for be in (make_backend("torch", dev), make_backend("flashinfer", dev)):
            m = to(meta, torch.bfloat16)
            cache = (kc.to(dev, torch.bfloat16).clone(), vc.to(dev, torch.bfloat16).clone())
            be.plan(m, 8, 2, 128, torch.bfloat16)
            outs.append(be.forward(q.to(dev, torch.bfloat16), k.to(dev, torch.bfloat16),
                                   v.to(dev, torch.bfloat16), cache, m, scale).float())
        torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_flashinfer_tree_mask_matches_torch():
    """The custom-mask (tree) path on FlashInfer, which plans FA2 kernels (FA3 has no custom masks)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    import dataclasses

    dev = torch.device("cuda")
    parents, prefix, q0 = [-1, 0, 0, 1], 20, 4
    m = torch.zeros(q0, prefix + q0, dtype=torch.bool)
    m[:, :prefix] = True
    for i in range(q0):
        j = i
        while j >= 0:
            m[i, prefix + j] = True
            j = parents[j]
    masks = [m, None]
    q_lens, kv_lens = [q0, 3], [prefix + q0, 9]
    meta, q, k, v, (kc, vc), _, _ = _setup(q_lens, kv_lens, hq=8, hkv=2, d=128, page_size=16, masks=masks)
    outs = []
    for be in (make_backend("torch", dev), make_backend("flashinfer", dev)):
        mm = dataclasses.replace(meta, positions=meta.positions.to(dev), slot_mapping=meta.slot_mapping.to(dev),
                                 qo_indptr=meta.qo_indptr.to(dev), kv_lens=meta.kv_lens.to(dev),
                                 page_table=meta.page_table.to(dev), backend_state={})
        cache = (kc.to(dev, torch.bfloat16).clone(), vc.to(dev, torch.bfloat16).clone())
        be.plan(mm, 8, 2, 128, torch.bfloat16)
        outs.append(be.forward(q.to(dev, torch.bfloat16), k.to(dev, torch.bfloat16), v.to(dev, torch.bfloat16),
                               cache, mm, 128**-0.5).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("q_lens", "kv_lens"), [([1, 1, 1], [4, 200, 1]), ([1], [300]), ([1], [20])])
def test_low_precision_decode_paths(q_lens, kv_lens):
    meta, q, k, v, (kc, vc), full_k, full_v = _setup(q_lens, kv_lens, seed=5)
    be = TorchAttention()
    be.plan(meta, 4, 2, 8, torch.bfloat16)
    out = be.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), (kc.bfloat16(), vc.bfloat16()), meta, 8**-0.5)
    ref = _reference(q, full_k, full_v, q_lens, kv_lens, None, 8**-0.5)
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
