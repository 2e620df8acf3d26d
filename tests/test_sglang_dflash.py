"""SGLang's DFlash layout (headstart/export/sglang_dflash.py): the names and dflash_config fields its
DFlashDraftModel reads, target_layer_ids counted as layer outputs (our aux id - 1), the refusals
(a draft vocabulary, aux 0), and the import of a checkpoint without our record."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_hf_model

from headstart.errors import AssetError
from headstart.export import export_head, import_head
from headstart.export.sglang_dflash import default_target_layers
from headstart.heads import HeadConfig, PackedBatch, build_head, build_vocab_maps
from headstart.heads.dflash import AnchoredBlocks
from headstart.models.llama import load_llama


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    make_hf_model("qwen3", d, seed=4)
    return load_llama(d, "fp32")


def _head(target, aux=(1, 2), vocab=None):
    torch.manual_seed(1)
    head = build_head(HeadConfig(head_type="dflash", aux_layer_ids=list(aux), num_layers=2, block_size=4,
                                 draft_vocab_size=vocab), target)
    if vocab:
        head.set_vocab_maps(*build_vocab_maps(torch.rand(320), vocab))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def _block_logits(head, target):
    gen = torch.Generator().manual_seed(7)
    n, d = 12, target.config.hidden_size
    batch = PackedBatch(torch.randint(0, 320, (n,), generator=gen), [6, 6], None,
                        torch.randn(n, 2, d, generator=gen), None)
    with torch.no_grad():
        return head.compute_logits(head.train_blocks(batch, AnchoredBlocks(torch.tensor([0, 7]),
                                                                           torch.tensor([0, 1]), 4)))


def test_the_layout_sglang_reads(tmp_path, target):
    head = _head(target)
    export_head(head, target, "sglang", tmp_path / "e")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_hidden_layers"] == 2
    # aux 1, 2 = the states entering layers 1, 2 = the outputs of layers 0, 1
    assert config["dflash_config"] == {"target_layer_ids": [0, 1], "block_size": 4,
                                       "mask_token_id": head.config.mask_token_id, "num_target_layers": 2}
    names = set(load_file(str(tmp_path / "e" / "model.safetensors")))
    layer = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")} \
        | {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
           "self_attn.k_norm.weight"}
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in (0, 1)
                                                                           for n in layer}
    back = import_head(tmp_path / "e", "sglang", target, tmp_path / "n")
    assert back.config.aux_layer_ids == [1, 2] and back.config.block_size == 4
    assert torch.equal(_block_logits(back, target), _block_logits(head, target))
    # SGLang's own checkpoint, without our record: read as SGLang reads it
    bare = {k: v for k, v in config.items() if k != "headstart"}
    (tmp_path / "e" / "config.json").write_text(json.dumps(bare))
    back = import_head(tmp_path / "e", "sglang", target, tmp_path / "n2")
    assert back.config.aux_layer_ids == [1, 2] and back.config.mask_token_id == head.config.mask_token_id
    assert torch.equal(_block_logits(back, target), _block_logits(head, target))
    wrong = bare | {"dflash_config": bare["dflash_config"] | {"num_target_layers": 30}}
    (tmp_path / "e" / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(AssetError, match="num_target_layers is 30, this target has 2"):
        import_head(tmp_path / "e", "sglang", target, tmp_path / "n3")
    no_mask = bare | {"dflash_config": {k: v for k, v in bare["dflash_config"].items() if k != "mask_token_id"}}
    (tmp_path / "e" / "config.json").write_text(json.dumps(no_mask))
    with pytest.raises(AssetError, match="mask_token_id must be a token id"):
        import_head(tmp_path / "e", "sglang", target, tmp_path / "n4")


def test_what_sglang_cannot_hold_is_refused_naming_why(tmp_path, target):
    with pytest.raises(AssetError, match="draft vocabulary.*DFlashDraftModel has no lm_head"):
        export_head(_head(target, vocab=64), target, "sglang", tmp_path / "a")
    with pytest.raises(AssetError, match="aux 0 .* is no layer's output"):
        export_head(_head(target, aux=(0, 1)), target, "sglang", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_sglangs_default_layer_ids():
    """dflash_utils.build_target_layer_ids: evenly over 1 .. L - 3, or L // 2 for one layer."""
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layers(32, 1) == [16]
    with pytest.raises(AssetError, match="at least 4 layers"):
        default_target_layers(2, 2)


def test_sglangs_default_layer_ids_round_as_sglang_does():
    # 1 + i * 28 / 3 = 1, 10.33, 19.67, 29: SGLang rounds (int(round(...))), a floor would give 19
    assert default_target_layers(32, 4) == [1, 10, 20, 29]


def test_a_target_without_silu_is_refused(tmp_path, target, monkeypatch):
    head = _head(target)
    monkeypatch.setattr(head.target.model.config, "hidden_act", "gelu_pytorch_tanh")
    with pytest.raises(AssetError, match="DFlash MLP takes SiLU only; this target's activation is gelu_pytorch_tanh"):
        export_head(head, target, "sglang", tmp_path / "e")
    assert not (tmp_path / "e").exists()


@pytest.fixture
def bare(tmp_path, target):
    """An SGLang DFlash export without our record (as SGLang's own checkpoints come), and an importer
    of it under another config.json."""
    export_head(_head(target), target, "sglang", tmp_path / "e")
    path = tmp_path / "e" / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k != "headstart"}

    def read(edited, name="n"):
        path.write_text(json.dumps(edited))
        return import_head(tmp_path / "e", "sglang", target, tmp_path / name)

    return config, read


def test_block_size_is_read_from_dflash_config_first_then_the_top_level(bare):
    config, read = bare
    dflash = {k: v for k, v in config["dflash_config"].items() if k != "block_size"}
    assert read({k: v for k, v in config.items() if k != "block_size"}, "a").config.block_size == 4
    assert read(config | {"dflash_config": dflash}, "b").config.block_size == 4
    with pytest.raises(AssetError, match="block_size 6 and dflash_config.block_size 4 disagree"):
        read(config | {"block_size": 6}, "c")  # SGLang would read dflash_config's; a contradiction is not guessed at
    neither = {k: v for k, v in config.items() if k != "block_size"} | {"dflash_config": dflash}
    assert read(neither, "d").config.block_size == 16  # DFlashDraftModel's default


@pytest.mark.parametrize(("edit", "match"), [
    ({"attention_bias": True}, "attention_bias is true; our dflash layers have no biases"),
    ({"dflash_config": {"target_layer_ids": [0, 2]}},
     r"target_layer_ids \[0, 2\] are outside this target's layers 0..1"),
    ({"dflash_config": {"target_layer_ids": [-1, 0]}}, r"target_layer_ids \[-1, 0\] are outside"),
    ({"dflash_config": {"target_layer_ids": []}}, "config.json: dflash_config.target_layer_ids is empty"),
    ({"dflash_config": {"num_target_layers": "2"}}, "config.json: dflash_config.num_target_layers must be an integer"),
    ({"dflash_config": {"mask_token_id": -1}}, r"config.json: dflash_config.mask_token_id -1 is outside the target's "
                                               r"vocabulary \(0..319\)"),
    ({"dflash_config": {"mask_token_id": 320}}, "config.json: dflash_config.mask_token_id 320 is outside"),
], ids=["bias", "layer-id-high", "layer-id-negative", "no-layer-ids", "layers-as-text", "mask-negative", "mask-high"])
def test_what_sglang_would_not_load_as_trained_is_refused_on_import(bare, tmp_path, edit, match):
    config, read = bare
    if "dflash_config" in edit:
        edit = {"dflash_config": config["dflash_config"] | edit["dflash_config"]}
    with pytest.raises(AssetError, match=match):
        read(config | edit)
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("name", ["embed_tokens.weight", "lm_head.weight", "model.lm_head.weight"])
def test_a_checkpoint_with_its_own_embedding_or_lm_head_is_refused(bare, tmp_path, target, name):
    config, read = bare
    weights = tmp_path / "e" / "model.safetensors"
    save_file(load_file(str(weights)) | {name: target.lm_head.weight.detach().clone()}, str(weights))
    with pytest.raises(AssetError, match=f"{name.removeprefix('model.')} is present; SGLang's DFlashDraftModel reads "
                                         "the target's embedding and lm_head"):
        read(config)


def test_tensor_names_under_model_are_read_as_sglangs_loader_reads_them(bare, tmp_path, target):
    config, read = bare
    weights = tmp_path / "e" / "model.safetensors"
    plain = load_file(str(weights))
    save_file({f"model.{k}": v for k, v in plain.items()}, str(weights))
    back = read(config)
    save_file(plain, str(weights))
    assert torch.equal(_block_logits(back, target), _block_logits(read(config, "n2"), target))
    save_file(plain | {"model.fc.weight": plain["fc.weight"].clone()}, str(weights))
    with pytest.raises(AssetError, match="model.fc.weight and fc.weight"):
        read(config, "n3")
