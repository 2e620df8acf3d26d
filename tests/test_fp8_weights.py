"""Block-scaled FP8 checkpoints (DeepSeek-V3/R1 as released): every linear weight of the decoder
layers is float8_e4m3fn with a `<name>_scale_inv` per block of config.json's weight_block_size, and
loads as each block times its scale. Tiny random targets are quantised here, block by block, with a
non-square block that divides few of the shapes (partial last blocks); the loader must give exactly
the test's own dequantisation, single-file, sharded and sliced for tensor parallelism."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_hf_model

from headstart.errors import AssetError
from headstart.models import load_target
from headstart.nn.attention import PackedCausalAttention, packed_metadata
from headstart.nn.parallel import TensorParallel

BLOCK = (24, 40)  # rows, columns: non-square (a swapped axis shows) and dividing few of the shapes below
FP8_MAX = 448.0  # the largest float8_e4m3fn
DEEPSEEK = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=128, bos_token_id=0,
                eos_token_id=1)


def _deepseek(path: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    model.save_pretrained(path)


def _quantised(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3 ships in FP8: the decoder layers' linear weights, not norms or the router."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and t.ndim == 2
            and "norm" not in name and not name.endswith("mlp.gate.weight"))


def _blocks(t: torch.Tensor):
    """(i, j, the view of block (i, j)) over a 2-D tensor, partial blocks at the ends."""
    for i in range(0, t.shape[0], BLOCK[0]):
        for j in range(0, t.shape[1], BLOCK[1]):
            yield i // BLOCK[0], j // BLOCK[1], t[i:i + BLOCK[0], j:j + BLOCK[1]]


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (R, C) -> FP8 (R, C), scale_inv (ceil(R/24), ceil(C/40)): each block's amax maps to 448."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1]))
    for (i, j, blk), (_, _, out) in zip(_blocks(w), _blocks(q), strict=True):
        scale[i, j] = blk.abs().max() / FP8_MAX
        out.copy_((blk / scale[i, j]).to(torch.float8_e4m3fn))
    return q, scale


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for (i, j, blk), (_, _, o) in zip(_blocks(q), _blocks(out), strict=True):
        o.copy_(blk.float() * scale[i, j])
    return out


def write_copies(src: Path, fp8: Path, ref: Path, scales_elsewhere: bool = False) -> dict[str, torch.Tensor]:
    """`fp8`: src quantised, with quantization_config; `ref`: the same values dequantised here, plain
    fp32. scales_elsewhere: fp8 is sharded, every scale in the second file. Returns fp8's tensors."""
    tensors = load_file(src / "model.safetensors")
    weights, scales, plain = {}, {}, {}
    for name, t in tensors.items():
        if _quantised(name, t):
            weights[name], scales[name + "_scale_inv"] = quantise(t)
            plain[name] = dequantise(weights[name], scales[name + "_scale_inv"])
        else:
            weights[name] = plain[name] = t
    cfg = json.loads((src / "config.json").read_text())
    for d in (fp8, ref):
        d.mkdir()
        for f in src.glob("*.json"):
            shutil.copy(f, d / f.name)
    save_file(plain, ref / "model.safetensors")
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    if not scales_elsewhere:
        save_file({**weights, **scales}, fp8 / "model.safetensors")
        return {**weights, **scales}
    files = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
    for file, part in files.items():
        save_file(part, fp8 / file)
    index = {"metadata": {}, "weight_map": {n: file for file, part in files.items() for n in part}}
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    return {**weights, **scales}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8-deepseek")
    _deepseek(root / "plain")
    write_copies(root / "plain", root / "fp8", root / "ref")
    return root


def _logits(model) -> torch.Tensor:
    prompts = [[(7 * i + 3 * j) % 150 + 3 for j in range(6 + 3 * i)] for i in range(3)]
    flat = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad():
        h, _ = model(flat, packed_metadata([len(p) for p in prompts]), [None] * model.num_layers,
                     PackedCausalAttention())
        return model.compute_logits(h)


def _assert_same_weights(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pa.items():
        assert torch.equal(p, pb[name]), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fp8_weights_load_as_each_block_times_its_scale(deepseek, dtype):
    """fp32 math, then the parameter's dtype: bit for bit the test's own dequantisation, loaded plain."""
    _assert_same_weights(load_target(deepseek / "fp8", dtype), load_target(deepseek / "ref", dtype))


def test_fp8_logits_are_the_originals_within_fp8_rounding(deepseek):
    """e4m3's 3 mantissa bits move each weight by up to 1/16 of itself: the logits stay within ~6% (L2)
    and pick the same tokens. Cast without the scales (what the loader did before), they are nowhere
    near: the test can fail."""
    want = _logits(load_target(deepseek / "plain", "fp32"))
    got = _logits(load_target(deepseek / "fp8", "fp32"))
    tensors = load_file(deepseek / "fp8" / "model.safetensors")
    unscaled = deepseek / "unscaled"
    shutil.copytree(deepseek / "fp8", unscaled)
    save_file({n: torch.ones_like(t) if n.endswith("_scale_inv") else t for n, t in tensors.items()},
              unscaled / "model.safetensors")
    cast = _logits(load_target(unscaled, "fp32"))
    assert (got - want).norm() < 0.1 * want.norm()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (cast - want).norm() > 0.5 * want.norm()


def test_a_scale_in_another_shard_is_found(tmp_path):
    make_hf_model("llama", tmp_path / "plain")
    write_copies(tmp_path / "plain", tmp_path / "fp8", tmp_path / "ref", scales_elsewhere=True)
    assert not any(n.endswith("_scale_inv") for n in load_file(tmp_path / "fp8" / "model-00001-of-00002.safetensors"))
    _assert_same_weights(load_target(tmp_path / "fp8", "fp32"), load_target(tmp_path / "ref", "fp32"))


@pytest.mark.parametrize("size", [2, 4])
def test_a_tensor_parallel_rank_reads_its_slice_of_an_fp8_weight(tmp_path, size):
    """Row slices (q/k/v heads, gate/up) and column slices (o_proj, down_proj) that start inside a
    block: the rank holds exactly what it holds of the dequantised weights."""
    make_hf_model("llama", tmp_path / "plain", seed=1)  # intermediate 112: down_proj slices start at 56 or 28
    write_copies(tmp_path / "plain", tmp_path / "fp8", tmp_path / "ref")
    for rank in range(size):
        tp = TensorParallel(rank, size)
        _assert_same_weights(load_target(tmp_path / "fp8", "fp32", tp=tp), load_target(tmp_path / "ref", "fp32", tp=tp))


def _fp8_copy(deepseek: Path, to: Path) -> Path:
    shutil.copytree(deepseek / "fp8", to)
    return to


def _drop_a_scale(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(tensors, d / "model.safetensors")


def _edit_config(d: Path, **quantization) -> None:
    cfg = json.loads((d / "config.json").read_text())
    if quantization:
        cfg["quantization_config"].update(quantization)
    else:
        del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))


def _stored_as(dtype: torch.dtype):
    """One weight re-stored in another FP8 format than the checkpoint declares."""
    def damage(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        name = "model.layers.1.self_attn.kv_b_proj.weight"
        tensors[name] = tensors[name].float().to(dtype)
        save_file(tensors, d / "model.safetensors")
    return damage


_as_fnuz = _stored_as(torch.float8_e4m3fnuz)  # other exponent bias, other scale semantics: not ours to read


@pytest.mark.parametrize("damage, named", [
    (_as_fnuz, r"kv_b_proj\.weight' is F8_E4M3FNUZ, an FP8 format this loader does not read"),
    (_drop_a_scale, r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.kv_b_proj\.weight' is FP8 .*"
                    r"no 'model\.layers\.1\.self_attn\.kv_b_proj\.weight_scale_inv'"),
    (_edit_config, r"config\.json: the weights are FP8 but there is no quantization_config"),
    (lambda d: _edit_config(d, weight_block_size=[128, 128]), r"weight_scale_inv' has shape .* in blocks of "
                                                              r"\[128, 128\] needs"),
])
def test_an_fp8_weight_without_its_scales_is_refused_by_name(deepseek, tmp_path, damage, named):
    d = _fp8_copy(deepseek, tmp_path / "broken")
    damage(d)
    with pytest.raises(AssetError, match=named):
        load_target(d, "fp32")


@pytest.mark.parametrize("quantization, named", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "quant_method 'compressed-tensors'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme 'static'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "int8"}, "fmt 'int8'"),
])
def test_a_quantisation_we_cannot_read_is_refused_by_name(deepseek, tmp_path, quantization, named):
    d = _fp8_copy(deepseek, tmp_path / "other")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = quantization
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssetError, match=named) as e:
        load_target(d, "fp32")
    assert str(d / "config.json") in str(e.value) and "dequantise" in str(e.value)


def _edit_scale(value):
    def damage(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        name = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
        s = tensors[name].clone()
        if value == "int":
            s = s.to(torch.int32)
        else:
            s[0, 0] = value
        tensors[name] = s
        save_file(tensors, d / "model.safetensors")
    return damage


_as_e5m2 = _stored_as(torch.float8_e5m2)


@pytest.mark.parametrize("damage, named", [
    (_edit_scale(float("nan")), r"kv_b_proj\.weight_scale_inv' holds 1 block scale\(s\) that are not finite and "
                                r"positive \(e\.g\. nan\)"),
    (_edit_scale(0.0), r"not finite and positive \(e\.g\. 0\.0\)"),  # over nonzero weights
    (_edit_scale(-1.0), r"not finite and positive \(e\.g\. -1\.0\)"),
    (_edit_scale("int"), r"kv_b_proj\.weight_scale_inv' has dtype torch\.int32"),
    (_as_e5m2, r"kv_b_proj\.weight' is torch\.float8_e5m2 but quantization_config\.fmt declares "
               r"torch\.float8_e4m3fn"),
])
def test_damaged_scales_and_a_mislabelled_format_are_refused_not_decoded_as_garbage(deepseek, tmp_path, damage,
                                                                                    named):
    d = _fp8_copy(deepseek, tmp_path / "damaged")
    damage(d)
    with pytest.raises(AssetError, match=named):
        load_target(d, "fp32")


def test_a_released_fp8_mtp_layer_imports_as_its_dequantised_values(deepseek, tmp_path):
    """`headstart import --format deepseek-mtp` of an MTP layer shipped in block-scaled FP8 (DeepSeek-V3/R1
    as released) gives the head the same checkpoint dequantised gives; its damaged scales are refused."""
    from headstart.export import export_head, import_head
    from headstart.heads import HeadConfig, build_head

    target = load_target(deepseek / "plain", "fp32")
    torch.manual_seed(0)
    head = build_head(HeadConfig(head_type="deepseek_mtp", postnorm_features=True), target)
    with torch.no_grad():  # no all-zero block (a zero block has a zero scale, which this test damages below)
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    export_head(head, target, "deepseek-mtp", tmp_path / "bf")
    tensors = load_file(tmp_path / "bf" / "model.safetensors")
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if _quantised(name, t):
            fp8[name], fp8[name + "_scale_inv"] = quantise(t.float())
            ref[name] = dequantise(fp8[name], fp8[name + "_scale_inv"])
        else:
            fp8[name] = ref[name] = t
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) >= 8
    cfg = json.loads((tmp_path / "bf" / "config.json").read_text())
    for d, weights, extra in (("fp8", fp8, {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                     "weight_block_size": list(BLOCK)}}),
                              ("ref", ref, {})):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text(json.dumps({**cfg, **extra}))
        save_file(weights, tmp_path / d / "model.safetensors")
    got = import_head(tmp_path / "fp8", "deepseek-mtp", target, tmp_path / "got").state_dict()
    want = import_head(tmp_path / "ref", "deepseek-mtp", target, tmp_path / "want").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    scale = next(n for n in fp8 if n.endswith("_scale_inv"))
    fp8[scale] = fp8[scale] * float("nan")
    save_file(fp8, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(AssetError, match="not finite and positive"):
        import_head(tmp_path / "fp8", "deepseek-mtp", target, tmp_path / "bad")
