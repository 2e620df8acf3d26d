"""Export -> import round trips for every head family x layout (logits identical), the serving names
and config fields of docs/formats.md, refusals with their reasons, and the CLI verbs."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_hf_model

from headstart.cli import main
from headstart.errors import AssetError
from headstart.export import export_head, import_head
from headstart.heads import HeadConfig, PackedBatch, build_head, build_vocab_maps, save_head
from headstart.models.llama import load_llama

CASES = [  # (target family, head type, draft vocab, format)
    ("llama", "eagle3", None, "sglang"), ("llama", "eagle3", 64, "sglang"), ("llama", "eagle3", 64, "vllm"),
    ("llama", "eagle3", None, "vllm"), ("llama", "eagle3", 320, "vllm"),
    ("qwen3", "eagle3", 64, "vllm"), ("llama", "eagle1", None, "sglang"), ("llama", "eagle1", None, "vllm"),
    ("llama", "eagle1-no-bias", None, "sglang"), ("qwen3", "mtp", None, "vllm"),
    ("llama", "mtp", None, "deepseek-mtp"), ("llama", "deepseek_mtp", None, "deepseek-mtp"),
    ("qwen2", "deepseek_mtp", None, "deepseek-mtp"), ("llama", "medusa", None, "medusa"),
    ("llama", "medusa", 64, "medusa"), ("llama", "draft_lm", None, "hf"), ("llama", "mtp", None, "native"),
    ("llama", "dflash", None, "vllm"), ("llama", "dflash", 64, "vllm"), ("qwen3", "dflash", 64, "vllm"),
    ("llama", "dflash", 64, "native"), ("llama", "dflash", None, "sglang"), ("qwen3", "dflash", None, "sglang"),
    # a target with q/k/v/o and MLP biases (mlp_bias: true): the heads' layers copy them
    ("llama-bias", "eagle3", 64, "vllm"), ("llama-bias", "eagle1", None, "sglang"),
    ("llama-bias", "draft_lm", None, "hf"), ("llama-bias", "eagle1", None, "vllm"),
]


@pytest.mark.parametrize(("family", "kind", "fmt"), [("qwen3", "mtp", "vllm"), ("llama", "mtp", "deepseek-mtp"),
                                                     ("llama", "deepseek_mtp", "deepseek-mtp")])
def test_a_pre_norm_head_is_refused_where_the_engine_feeds_the_post_norm_state(tmp_path, targets, family, kind,
                                                                               fmt):
    target = targets[family]
    with pytest.raises(AssetError, match="after its final norm.*head.postnorm_features: true"):
        export_head(_head(target, kind, None, postnorm=False), target, fmt, tmp_path / "exp")
    assert not (tmp_path / "exp").exists()
    export_head(_head(target, kind, None), target, fmt, tmp_path / "ok")
    meta = json.loads((tmp_path / "ok" / "config.json").read_text())["headstart"]
    assert meta["feature_convention"].startswith("last_hidden_post_norm")


@pytest.fixture(autouse=True)
def deepseek_layout_on_llama_blocks(monkeypatch):
    """The DeepSeek-MTP layout is refused for every target but DeepSeek's (test_export_outputs.py
    checks the refusal); no DeepSeek target loads yet, so its name mapping is checked here on the
    tiny Llama-family blocks."""
    from headstart.export import deepseek_mtp

    monkeypatch.setattr(deepseek_mtp, "DEEPSEEK_MODEL_TYPES",
                        deepseek_mtp.DEEPSEEK_MODEL_TYPES + ("llama", "qwen2", "qwen3"))


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    out = {}
    for fam in ("llama", "qwen3", "qwen2", "llama-bias"):
        d = tmp_path_factory.mktemp(fam)
        make_hf_model(fam, d, seed=4)
        out[fam] = load_llama(d, "fp32")
    return out


# eagle3 heads here carry the EAGLE-3.1 flags SGLang implements too (fc_norm, norm_output), so that
# every layout holds them; test_eagle31_flags_round_trip covers every combination in vLLM's.
SGLANG_EAGLE31 = {"norm_before_fc": False, "fc_norm": True, "norm_before_residual": False, "norm_output": True}


def _head(target, kind, dv, seed=1, aux=(1, 2), postnorm=True, flags=None):
    """aux: SGLang cannot name aux layer 0 (the tiny target has 2 layers); ids are distinct and ascending.
    postnorm: mtp / deepseek_mtp heads read the post-norm state, as the engines that serve them feed.
    flags: an eagle3 head's EAGLE-3.1 flags (default SGLANG_EAGLE31), an eagle1 head's (default: the family's)."""
    torch.manual_seed(seed)
    flags = (SGLANG_EAGLE31 if flags is None else flags) if kind == "eagle3" else (flags or {})
    head = build_head(HeadConfig(head_type=kind, draft_vocab_size=dv, **flags,
                                 aux_layer_ids=list(aux) if kind in ("eagle3", "dflash") else None,
                                 postnorm_features=True if postnorm and kind in ("mtp", "deepseek_mtp") else None,
                                 num_layers=2 if kind == "dflash" else 1, block_size=4 if kind == "dflash" else None),
                      target)
    if dv:
        d2t, t2d = build_vocab_maps(torch.rand(320), dv)
        head.set_vocab_maps(d2t, t2d) if kind in ("eagle3", "dflash") else head.set_vocab_maps(d2t)
    with torch.no_grad():  # away from the target-copied start, so a swapped tensor shows
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def _logits(head, target):
    gen = torch.Generator().manual_seed(7)
    n, d = 9, target.config.hidden_size
    aux = len(head.config.aux_layer_ids or [])
    batch = PackedBatch(torch.randint(0, 320, (n,), generator=gen), [4, 5], torch.randn(n, d, generator=gen),
                        torch.randn(n, aux, d, generator=gen) if aux else None, None)
    if head.config.head_type == "dflash":  # blocks of 4 at row 0 (first sequence, twice) and 5 (second)
        from headstart.heads.dflash import AnchoredBlocks

        with torch.no_grad():
            h = head.train_blocks(batch, AnchoredBlocks(torch.tensor([0, 0, 5]), torch.tensor([0, 0, 1]), 4))
            return head.compute_logits(h)
    with torch.no_grad():
        h, _ = head.train_forward(batch)
        return head.compute_logits(h)


@pytest.mark.parametrize(("family", "kind", "dv", "fmt"), CASES)
def test_export_then_import_reproduces_the_logits_exactly(tmp_path, targets, family, kind, dv, fmt):
    target = targets[family]
    no_bias = (kind, fmt) == ("eagle1", "vllm") or kind == "eagle1-no-bias"  # vLLM's fc has none; SGLang: a zero one
    kind = kind.removesuffix("-no-bias")
    head = _head(target, kind, dv, aux=(0, 1, 2) if fmt == "vllm" else (1, 2),
                 flags={"fc_bias": False} if no_bias else None)
    export_head(head, target, fmt, tmp_path / "exp")
    if fmt == "native":
        from headstart.heads import load_head

        back = load_head(tmp_path / "exp", target)
    else:
        back = import_head(tmp_path / "exp", fmt, target, tmp_path / "native")
        assert (tmp_path / "native" / "config.json").exists()
    assert back.config.head_type == kind
    assert torch.equal(_logits(back, target), _logits(head, target))


def _names(path):
    return set(load_file(str(path / "model.safetensors")))


def test_a_full_vocabulary_eagle3_export_for_vllm_carries_no_vocabulary_maps(tmp_path, targets):
    """vLLM 0.32 builds no draft_id_to_target_id for draft_vocab_size == vocab_size and refuses a
    checkpoint with a d2t (found by tests/test_vllm.py)."""
    target = targets["llama"]
    export_head(_head(target, "eagle3", None, aux=(0, 1, 2)), target, "vllm", tmp_path / "exp")
    assert not {"d2t", "t2d"} & _names(tmp_path / "exp")
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config["draft_vocab_size"] == target.config.vocab_size


def test_serving_names_and_config_fields(tmp_path, targets):
    """The names and fields of docs/formats.md (checked against SGLang / vLLM / speculators sources)."""
    llama, qwen3 = targets["llama"], targets["qwen3"]
    layer = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")} \
        | {"post_attention_layernorm.weight"}
    # SGLang EAGLE-3
    export_head(_head(llama, "eagle3", 64), llama, "sglang", tmp_path / "sg3")
    assert _names(tmp_path / "sg3") == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                                        "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                                        "fc_norm.0.weight", "fc_norm.1.weight"} | {f"midlayer.{n}" for n in layer}
    t = load_file(str(tmp_path / "sg3" / "model.safetensors"))
    assert list(t["fc.weight"].shape) == [64, 128] and list(t["midlayer.self_attn.q_proj.weight"].shape) == [64, 128]
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert list(t["lm_head.weight"].shape) == [64, 64]
    c = json.loads((tmp_path / "sg3" / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
    assert c["draft_vocab_size"] == 64 and c["target_hidden_size"] == 64 and c["tie_word_embeddings"] is False
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # SGLang: layer outputs
    assert c["fc_norm"] is True and c["norm_output"] is True  # LlamaForCausalLMEagle3 reads them from the config
    # vLLM speculators eagle3, with the EAGLE-3.1 defaults of a new head
    export_head(_head(llama, "eagle3", 64, aux=(0, 1, 2), flags={}), llama, "vllm", tmp_path / "v3")
    assert _names(tmp_path / "v3") == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "input_norm.weight",
                                       "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight"} \
        | {f"layers.0.{n}" for n in layer}
    assert list(load_file(str(tmp_path / "v3" / "model.safetensors"))["input_norm.weight"].shape) == [192]
    c = json.loads((tmp_path / "v3" / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["draft_vocab_size"] == 64
    assert (c["norm_before_fc"], c["fc_norm"], c["norm_before_residual"], c["norm_output"]) == (True, False, True, True)
    assert c["target_hidden_size"] == 64
    assert c["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # vLLM: the states entering the layers
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1
    assert c["speculators_config"]["verifier"]["name_or_path"] == str(llama.source_dir)
    assert c["transformer_layer_config"]["model_type"] == "llama"
    # vLLM's EAGLE-1 directory: fc without a bias, the first layer without its input norm, no embedding / lm_head
    export_head(_head(llama, "eagle1", None, flags={"fc_bias": False}), llama, "vllm", tmp_path / "v1")
    assert _names(tmp_path / "v1") == {"fc.weight"} | {f"layers.0.{n}" for n in layer}
    c = json.loads((tmp_path / "v1" / "config.json").read_text())
    assert c["architectures"] == ["EagleLlamaForCausalLM"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and "speculators_model_type" not in c
    # SGLang's EAGLE-1 always has an fc bias: a head without one gets a zero bias
    export_head(_head(llama, "eagle1", None, flags={"fc_bias": False}), llama, "sglang", tmp_path / "s1")
    assert not load_file(str(tmp_path / "s1" / "model.safetensors"))["fc.bias"].any()
    # vLLM speculators mtp (Qwen3 target)
    export_head(_head(qwen3, "mtp", None), qwen3, "vllm", tmp_path / "vm")
    p = "mtp_layers.0."
    assert _names(tmp_path / "vm") == {p + n for n in layer | {
        "hidden_layernorm.weight", "token_layernorm.weight", "input_proj.weight", "final_layernorm.weight",
        "input_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"}}
    c = json.loads((tmp_path / "vm" / "config.json").read_text())
    assert c["speculators_model_type"] == "mtp" and c["num_nextn_predict_layers"] == 1
    assert c["transformer_layer_config"]["model_type"] == "qwen3"
    # DeepSeek MTP at model.layers.{L}
    export_head(_head(llama, "deepseek_mtp", None), llama, "deepseek-mtp", tmp_path / "ds")
    p = "model.layers.2."
    assert _names(tmp_path / "ds") == {p + n for n in layer | {
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
        "embed_tokens.weight", "input_layernorm.weight"}}
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # vLLM Medusa
    export_head(_head(llama, "medusa", 64), llama, "medusa", tmp_path / "md")
    assert _names(tmp_path / "md") == {f"blocks.{h}.layers.0.{w}" for h in range(4) for w in ("weight", "bias")} \
        | {"lm_heads.0.weight", "token_map"}
    c = json.loads((tmp_path / "md" / "config.json").read_text())
    assert (c["num_heads"], c["num_hidden_layers"], c["truncated_vocab_size"]) == (4, 1, 64)


@pytest.mark.parametrize(("family", "kind", "fmt", "reason"), [
    ("llama", "mtp", "sglang", "holds eagle3, eagle1, dflash heads, not 'mtp'"),
    ("llama", "mtp", "vllm", "Qwen3-family targets only"),
    ("llama", "eagle1", "vllm", "no fc bias.*head.fc_bias: false"),
    ("qwen3", "eagle1", "vllm", "built on Llama layers"),
    ("qwen3", "eagle3", "sglang", "no q/k norms"),
    ("llama", "medusa", "hf", "holds draft_lm heads"),
])
def test_a_layout_that_cannot_hold_the_head_is_refused_with_the_reason(tmp_path, targets, family, kind, fmt, reason):
    target = targets[family]
    with pytest.raises(AssetError, match=reason):
        export_head(_head(target, kind, None), target, fmt, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_import_names_a_misfit_tensor_with_both_shapes_and_an_unknown_layout(tmp_path, targets):
    llama = targets["llama"]
    export_head(_head(llama, "eagle3", 64), llama, "sglang", tmp_path / "e")
    t = load_file(str(tmp_path / "e" / "model.safetensors"))
    t["fc.weight"] = torch.zeros(64, 192)
    save_file(t, str(tmp_path / "e" / "model.safetensors"))
    with pytest.raises(AssetError, match=r"fc\.weight has shape \[64, 192\], this target needs \[64, 128\]"):
        import_head(tmp_path / "e", "sglang", llama, tmp_path / "n")
    with pytest.raises(AssetError, match="not a vllm checkpoint: found speculators_model_type None"):
        import_head(tmp_path / "e", "vllm", llama, tmp_path / "n")
    with pytest.raises(AssetError, match="architectures"):
        import_head(llama.source_dir, "sglang", llama, tmp_path / "n")
    del t["norm.weight"]
    t["fc.weight"] = torch.zeros(64, 192)
    save_file(t, str(tmp_path / "e" / "model.safetensors"))
    with pytest.raises(AssetError, match=r"missing \['norm.weight'\]"):
        import_head(tmp_path / "e", "sglang", llama, tmp_path / "n")
    assert not (tmp_path / "n").exists()


def test_export_and_import_verbs(tmp_path, targets, capsys):
    llama = targets["llama"]
    save_head(_head(llama, "eagle3", 64), tmp_path / "head")
    model = str(llama.source_dir)
    assert main(["export", str(tmp_path / "head"), "--format", "sglang", "--out", str(tmp_path / "sg"),
                 "--model", model]) == 0
    assert "read back: logits identical" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "head"), "--format", "sglang", "--out", str(tmp_path / "sg"),
                 "--model", model]) == 2  # exists: refused without --force
    assert main(["export", str(tmp_path / "head"), "--format", "sglang", "--out", str(tmp_path / "sg"),
                 "--model", model, "--force"]) == 0
    assert main(["import", str(tmp_path / "sg"), "--format", "eagle", "--target", model, "--out",
                 str(tmp_path / "back")]) == 0
    assert main(["export", str(tmp_path / "head"), "--format", "medusa", "--out", str(tmp_path / "m"),
                 "--model", model]) == 2
    err = capsys.readouterr().err
    assert err.count("headstart: error:") == 2 and "medusa layout holds medusa heads" in err


STRIPPABLE = [c for c in CASES if c[3] != "native" and not (c[1] == "mtp" and c[3] == "deepseek-mtp")]


@pytest.mark.parametrize(("family", "kind", "dv", "fmt"), STRIPPABLE)
def test_import_without_our_metadata_reads_the_layout_itself(tmp_path, targets, family, kind, dv, fmt):
    """A checkpoint written by another tool carries no `headstart` key: the layout alone must give the
    same head (type, aux layers, vocabulary, shape) and the same logits."""
    target = targets[family]
    no_bias = (kind, fmt) == ("eagle1", "vllm") or kind == "eagle1-no-bias"  # vLLM's fc has none; SGLang: a zero one
    kind = kind.removesuffix("-no-bias")
    head = _head(target, kind, dv, aux=(0, 1, 2) if fmt == "vllm" else (1, 2),
                 flags={"fc_bias": False} if no_bias else None)
    export_head(head, target, fmt, tmp_path / "exp")
    cfg_path = tmp_path / "exp" / "config.json"
    raw = json.loads(cfg_path.read_text())
    del raw["headstart"]
    cfg_path.write_text(json.dumps(raw))
    back = import_head(tmp_path / "exp", fmt, target, tmp_path / "native")
    for key in ("head_type", "num_layers", "aux_layer_ids", "medusa_num_heads", "share_target_embeddings"):
        assert getattr(back.config, key) == getattr(head.config, key), key
    assert (back.config.draft_vocab_size or 320) == (head.config.draft_vocab_size or 320)
    assert torch.equal(_logits(back, target), _logits(head, target))


def test_the_hf_export_is_what_transformers_computes(tmp_path, targets):
    """An independent reader of our q/k/v and gate/up split: transformers itself."""
    from transformers import AutoModelForCausalLM

    from headstart.nn.attention import PackedCausalAttention, packed_metadata

    llama = targets["llama"]
    head = _head(llama, "draft_lm", None)
    export_head(head, llama, "hf", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (10,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
        h = head.forward_hidden(ids, None, packed_metadata([10]), None, PackedCausalAttention())
        got = head.compute_logits(h)
    assert torch.allclose(got, want, atol=1e-5)


def test_layouts_agree_with_the_layouts_speculators_checks(tmp_path, targets):
    """SGLang's EAGLE-3 and DeepSeek's MTP names hold the same tensors as the vLLM layouts that
    tests/test_serving.py loads with speculators' own classes; and the values are the head's own."""
    llama, qwen3 = targets["llama"], targets["qwen3"]
    head = _head(llama, "eagle3", 64, aux=(1, 2))
    export_head(head, llama, "sglang", tmp_path / "sg")
    export_head(head, llama, "vllm", tmp_path / "vl")
    sg = load_file(str(tmp_path / "sg" / "model.safetensors"))
    vl = load_file(str(tmp_path / "vl" / "model.safetensors"))
    assert {k.replace("midlayer.", "layers.0."): v for k, v in sg.items()}.keys() == vl.keys()
    for k, v in sg.items():
        assert torch.equal(v, vl[k.replace("midlayer.", "layers.0.")]), k
    assert torch.equal(sg["fc.weight"], head.fc.weight)
    qkv = head.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(torch.cat([sg[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]), qkv)
    assert torch.equal(sg["midlayer.input_layernorm.weight"], head.embed_norm.weight)
    assert torch.equal(sg["midlayer.hidden_norm.weight"], head.hidden_norm.weight)
    mtp = _head(qwen3, "mtp", None)
    export_head(mtp, qwen3, "vllm", tmp_path / "vm")
    export_head(mtp, qwen3, "deepseek-mtp", tmp_path / "ds")
    vm = load_file(str(tmp_path / "vm" / "model.safetensors"))
    ds = load_file(str(tmp_path / "ds" / "model.safetensors"))
    names = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
             "shared_head.norm": "final_layernorm"}
    for k, v in ds.items():
        rest = k.removeprefix("model.layers.2.")
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            continue
        base = rest.removesuffix(".weight")
        assert torch.equal(v, vm["mtp_layers.0." + names.get(base, base) + ".weight"]), k
    assert torch.equal(ds["model.layers.2.enorm.weight"], mtp.embed_norm.weight)
    medusa = _head(llama, "medusa", 64)
    export_head(medusa, llama, "medusa", tmp_path / "md")
    md = load_file(str(tmp_path / "md" / "model.safetensors"))
    assert torch.equal(md["token_map"], torch.arange(64) + medusa.d2t)
    assert torch.equal(md["blocks.2.layers.0.weight"], medusa.heads[2][0].linear.weight)


def test_an_export_that_would_not_reproduce_the_head_is_not_kept(tmp_path, targets, monkeypatch):
    from headstart.export.formats import LAYOUTS

    llama = targets["llama"]
    head = _head(llama, "eagle3", 64)
    write = LAYOUTS["sglang"].write

    def faulty(h, t):  # a writer bug: one tensor slightly off
        config, tensors = write(h, t)
        tensors["fc.weight"] = tensors["fc.weight"] * 1.01
        return config, tensors

    monkeypatch.setattr(LAYOUTS["sglang"], "write", faulty)
    with pytest.raises(AssetError, match="read back gives other logits"):
        export_head(head, llama, "sglang", tmp_path / "x")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x*"))
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    monkeypatch.undo()
    with pytest.raises(AssetError, match="fc.weight holds NaN"):
        export_head(head, llama, "sglang", tmp_path / "x")


def test_force_replaces_only_an_earlier_export_and_never_the_source(tmp_path, targets, capsys):
    llama = targets["llama"]
    save_head(_head(llama, "eagle3", 64), tmp_path / "head")
    model = str(llama.source_dir)
    other = tmp_path / "other-head"
    save_head(_head(llama, "mtp", None), other)
    for out in (tmp_path / "head", other):
        assert main(["export", str(tmp_path / "head"), "--format", "sglang", "--out", str(out), "--model", model,
                     "--force"]) == 2
    assert main(["export", str(tmp_path / "head"), "--format", "native", "--out", str(tmp_path / "head"),
                 "--model", model, "--force"]) == 2
    err = capsys.readouterr().err
    assert "the head being exported" in err
    assert json.loads((other / "config.json").read_text())["head_type"] == "mtp"  # untouched


def test_import_refuses_bad_values_and_another_targets_export(tmp_path, targets):
    llama, qwen2 = targets["llama"], targets["qwen2"]
    export_head(_head(llama, "eagle3", 64, aux=(0, 1, 2)), llama, "vllm", tmp_path / "e")
    f = tmp_path / "e" / "model.safetensors"
    good = load_file(str(f))
    cfg_path = tmp_path / "e" / "config.json"
    good_cfg = json.loads(cfg_path.read_text())
    other = load_llama(llama.source_dir, "fp32")
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)  # same shape, other weights
    other._fingerprint = "0" * 64
    with pytest.raises(AssetError, match="made for target"):
        import_head(tmp_path / "e", "vllm", other, tmp_path / "n")
    cases = [
        ({"fc.weight": good["fc.weight"].clone().fill_(float("nan"))}, None, "fc.weight holds NaN"),
        ({"d2t": good["d2t"] + 400}, None, "d2t maps draft ids outside the target vocabulary"),
        ({"t2d": torch.zeros_like(good["t2d"])}, None, "t2d does not mark the tokens d2t maps to"),
        ({"norm.weight": good["norm.weight"].to(torch.int32)}, None, "norm.weight has dtype torch.int32"),
        ({}, {"draft_vocab_size": "abc"}, "draft_vocab_size"),
        ({}, {"transformer_layer_config": [1]}, "transformer_layer_config"),
    ]
    for tensors, config, match in cases:
        save_file({**good, **tensors}, str(f))
        cfg = {**good_cfg, **(config or {})}
        cfg.pop("headstart")
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(AssetError, match=match):
            import_head(tmp_path / "e", "vllm", llama, tmp_path / "n")
    no_t2d = dict(good)
    del no_t2d["t2d"]  # vLLM ignores t2d: it is rebuilt from d2t
    save_file(no_t2d, str(f))
    cfg_path.write_text(json.dumps({k: v for k, v in good_cfg.items() if k != "headstart"}))
    import_head(tmp_path / "e", "vllm", llama, tmp_path / "n")
    save_file(good, str(tmp_path / "e" / "extra.safetensors"))
    with pytest.raises(AssetError, match="several weight files"):
        import_head(tmp_path / "e", "vllm", llama, tmp_path / "n2")
    (tmp_path / "e" / "extra.safetensors").unlink()
    (tmp_path / "empty").mkdir()
    with pytest.raises(AssetError, match="config.json"):
        import_head(tmp_path / "empty", "vllm", llama, tmp_path / "n2")
    with pytest.raises(AssetError, match=r"missing \['layers.0.self_attn.k_proj.bias'"):  # qwen2: qkv biases
        import_head(tmp_path / "e", "vllm", qwen2, tmp_path / "n2")


def test_more_import_refusals_and_native_force(tmp_path, targets, capsys):
    llama = targets["llama"]
    export_head(_head(llama, "eagle3", 64, aux=(0, 1, 2)), llama, "vllm", tmp_path / "e")
    f, cfg_path = tmp_path / "e" / "model.safetensors", tmp_path / "e" / "config.json"
    good, good_cfg = load_file(str(f)), json.loads(cfg_path.read_text())
    d2t = good["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft ids 0 and 1 both map to target id 0 + d2t[0]
    save_file({**good, "d2t": d2t}, str(f))
    with pytest.raises(AssetError, match="two draft ids to one target token"):
        import_head(tmp_path / "e", "vllm", llama, tmp_path / "n")
    save_file({**good, "fc.weight": good["fc.weight"].to(torch.float8_e4m3fn)}, str(f))
    with pytest.raises(AssetError, match="float8"):
        import_head(tmp_path / "e", "vllm", llama, tmp_path / "n")
    save_file(good, str(f))
    cfg_path.write_text(json.dumps({**good_cfg, "eagle_aux_hidden_state_layer_ids": [0, 2]}))
    with pytest.raises(AssetError, match="aux_layer_ids.*edited after export"):
        import_head(tmp_path / "e", "vllm", llama, tmp_path / "n")
    save_head(_head(llama, "mtp", None), tmp_path / "trained")
    model = str(llama.source_dir)
    save_head(_head(llama, "mtp", None), tmp_path / "src" / "head")
    assert main(["export", str(tmp_path / "src" / "head"), "--format", "native", "--out", str(tmp_path / "trained"),
                 "--model", model, "--force"]) == 2  # a plain head checkpoint is not an earlier export
    assert main(["export", str(tmp_path / "src" / "head"), "--format", "native", "--out", str(tmp_path / "src"),
                 "--model", model, "--force"]) == 2  # --out holds the source
    assert main(["export", str(tmp_path / "src" / "head"), "--format", "native", "--out", str(tmp_path / "nat"),
                 "--model", model]) == 0
    assert main(["export", str(tmp_path / "src" / "head"), "--format", "native", "--out", str(tmp_path / "nat"),
                 "--model", model, "--force"]) == 0  # an earlier native export is replaced
    assert (tmp_path / "trained" / "config.json").exists() and (tmp_path / "src" / "head" / "config.json").exists()


def test_vllm_import_checks_the_layer_config_and_the_target_width(tmp_path, targets):
    llama = targets["llama"]
    export_head(_head(llama, "eagle3", 64, aux=(0, 1, 2)), llama, "vllm", tmp_path / "v")
    cfg = tmp_path / "v" / "config.json"
    good = json.loads(cfg.read_text())
    layer = good["transformer_layer_config"]
    for i, (bad, match) in enumerate((
            ({**good, "target_hidden_size": 128}, "target_hidden_size=128 but the target has 64"),
            ({**good, "transformer_layer_config": {**layer, "num_attention_heads": 8}},
             "transformer_layer_config.num_attention_heads=8"),
            ({**good, "transformer_layer_config": {**layer, "vocab_size": 7}},
             "transformer_layer_config.vocab_size=7"))):
        cfg.write_text(json.dumps(bad))
        with pytest.raises(AssetError, match=match):
            import_head(tmp_path / "v", "vllm", llama, tmp_path / f"n{i}")
        assert not (tmp_path / f"n{i}").exists()


def test_every_export_records_the_state_its_head_reads(tmp_path, targets):
    from headstart.export.layout_configs import feature_convention

    llama = targets["llama"]
    want = {("mtp", False): "last_hidden_pre_norm", ("mtp", True): "last_hidden_post_norm",
            ("deepseek_mtp", False): "last_hidden_pre_norm", ("eagle1", False): "last_hidden_post_norm",
            ("medusa", False): "last_hidden_post_norm", ("eagle3", False): "hidden states entering target layers",
            ("draft_lm", False): "none"}
    for (kind, post), start in want.items():
        head = _head(llama, kind, None, postnorm=post)
        assert feature_convention(head).startswith(start), (kind, post)
    export_head(_head(llama, "medusa", None), llama, "medusa", tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())["headstart"]
    assert meta["feature_convention"].startswith("last_hidden_post_norm")
