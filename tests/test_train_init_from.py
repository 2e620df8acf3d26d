"""head.init_from: training starts from a trained head checkpoint (fine-tuning it on the recipe's data), its
weights and its draft vocabulary, instead of a new head; a checkpoint of another shape or with damaged files is
refused by name before anything is written."""

import json

import pytest
import torch
from conftest import write_jsonl
from safetensors.torch import load_file
from test_train import _recipe

from headstart.errors import AssetError
from headstart.recipe_io import load_recipe

EAGLE3 = "  aux_layer_ids: [0, 1, 2]\n  draft_vocab_size: 40\n"


def _train(path, tmp_path, *sets, out, resume=False):
    from headstart.train import run_train

    return run_train(load_recipe(path, [*sets, f"output_dir={tmp_path / out}"]), resume=resume, progress=False)


@pytest.fixture(scope="module")
def first(tmp_path_factory, chat_model_dir):
    """An eagle3 head with a draft vocabulary trained a few steps on one data file (read only: copy to alter)."""
    tmp = tmp_path_factory.mktemp("first")
    path = _recipe(tmp, chat_model_dir, name="a", head="eagle3", extra=EAGLE3, train={"max_steps": 3})
    _train(path, tmp, out="a")
    return tmp / "a" / "head-final"


def _other_data_recipe(tmp_path, chat_model_dir, extra=EAGLE3, **train):
    """The same head section on conversations in other words: a draft vocabulary built from them differs."""
    import random

    rng, words = random.Random(11), ["zebra", "quantum", "violin", "marble", "orbit", "copper", "lantern", "fjord"]
    rows = [{"id": f"b{i}", "conversations": [
        {"from": role, "value": " ".join(rng.choice(words) for _ in range(rng.randint(4, 20)))}
        for role in ("human", "gpt")]} for i in range(48)]
    write_jsonl(tmp_path / "b.jsonl", rows)
    return _recipe(tmp_path, chat_model_dir, name="b", head="eagle3", extra=extra, train={"max_steps": 1, **train})


def test_a_run_starts_from_the_heads_weights_and_keeps_its_draft_vocabulary(tmp_path, chat_model_dir, first):
    """One step at a vanishing learning rate: every weight is the initial head's (not a new head's, not the
    target's copied layer: init_from_target is true by default here), and so are d2t / t2d, although the new
    data's most frequent tokens differ. train.json records which weights it started from."""
    path = _other_data_recipe(tmp_path, chat_model_dir, lr=1e-12, warmup_steps=0)
    _train(path, tmp_path, f"head.init_from={first}", out="b")
    start, after = load_file(str(first / "model.safetensors")), load_file(str(tmp_path / "b" / "head-final" /
                                                                            "model.safetensors"))
    assert start.keys() == after.keys()
    for name, t in start.items():
        assert torch.allclose(after[name].float(), t.float(), atol=1e-8, rtol=0), name
    _train(path, tmp_path, "train.lr=1e-12", "train.warmup_steps=0", out="fresh")  # the same run from a new head
    fresh = load_file(str(tmp_path / "fresh" / "head-final" / "model.safetensors"))
    assert not torch.equal(fresh["d2t"], start["d2t"])  # the new data would have chosen other tokens
    assert not torch.allclose(fresh["fc.weight"].float(), start["fc.weight"].float())
    ident = json.loads((tmp_path / "b" / "train.json").read_text())["recipe"]
    assert ident["resolved.init_from_sha256"] == json.loads((first / "config.json").read_text())["weights_sha256"]
    assert "resolved.init_from_sha256" not in json.loads((tmp_path / "fresh" / "train.json").read_text())["recipe"]


def test_fine_tuning_moves_the_weights_from_the_initial_head(tmp_path, chat_model_dir, first):
    path = _other_data_recipe(tmp_path, chat_model_dir, max_steps=2)
    _train(path, tmp_path, f"head.init_from={first}", out="b")
    start = load_file(str(first / "model.safetensors"))
    after = load_file(str(tmp_path / "b" / "head-final" / "model.safetensors"))
    assert torch.equal(after["d2t"], start["d2t"]) and torch.equal(after["t2d"], start["t2d"])
    assert not torch.allclose(after["fc.weight"].float(), start["fc.weight"].float())


@pytest.mark.parametrize("change, key", [
    ("head.draft_vocab_size=48", "draft_vocab_size"),
    ("head.num_layers=2", "num_layers"),
    ("head.aux_layer_ids=[0,1]", "aux_layer_ids"),
    ("head.norm_output=false", "norm_output"),
])
def test_a_head_of_another_shape_is_refused_by_name(tmp_path, chat_model_dir, first, change, key):
    path = _other_data_recipe(tmp_path, chat_model_dir)
    with pytest.raises(AssetError, match=rf"head.init_from .*: its {key} is .* but the recipe's head has"):
        _train(path, tmp_path, f"head.init_from={first}", change, out="b")
    assert not (tmp_path / "b").exists()


def test_another_family_is_refused(tmp_path, chat_model_dir, first):
    path = _recipe(tmp_path, chat_model_dir, name="m", head="mtp", train={"max_steps": 1})
    with pytest.raises(AssetError, match="head_type is eagle3 but the recipe's head has mtp"):
        _train(path, tmp_path, f"head.init_from={first}", out="m")


def test_a_missing_or_damaged_checkpoint_is_refused(tmp_path, chat_model_dir, first):
    path = _other_data_recipe(tmp_path, chat_model_dir)
    with pytest.raises(AssetError, match=r"head.init_from .*nowhere: no such directory"):
        _train(path, tmp_path, f"head.init_from={tmp_path / 'nowhere'}", out="b")
    (tmp_path / "plain").mkdir()
    with pytest.raises(AssetError, match="not a head checkpoint"):
        _train(path, tmp_path, f"head.init_from={tmp_path / 'plain'}", out="b")
    import shutil

    first = shutil.copytree(first, tmp_path / "copy")
    weights = first / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(AssetError, match="sha256 differs"):
        _train(path, tmp_path, f"head.init_from={first}", out="b")
    assert not (tmp_path / "b").exists()


# every key of the head's shape, without training: a checkpoint of another shape is refused naming the key

SHAPES = [("num_layers", 2), ("draft_vocab_size", 48), ("aux_layer_ids", [0, 1]), ("fc_norm", False),
          ("norm_before_residual", False), ("norm_output", False), ("intermediate_size", 56),
          ("num_key_value_heads", 1)]


@pytest.mark.parametrize("key, value", SHAPES, ids=[k for k, _ in SHAPES])
def test_start_from_head_compares_every_key_of_the_shape(tmp_path, chat_model_dir, key, value):
    import dataclasses

    from headstart.heads import HeadConfig, build_head, save_head, start_from_head
    from headstart.models import load_target

    target = load_target(chat_model_dir, "fp32")
    base = HeadConfig(head_type="eagle3", aux_layer_ids=[0, 1, 2], draft_vocab_size=40, fc_norm=True,
                      norm_before_fc=False)
    other = dataclasses.replace(base, **{key: value})
    save_head(build_head(other, target, init_from_target=False), tmp_path / "h")
    head = build_head(base, target, init_from_target=False)
    recipe_key = key not in ("intermediate_size", "num_key_value_heads")
    hint = f"set head.{key} to the checkpoint's" if recipe_key else "not a recipe key"
    with pytest.raises(AssetError, match=rf"its {key} is .* but the recipe's head has .*\({hint}"):
        start_from_head(head, tmp_path / "h", target)
    same = build_head(base, target, init_from_target=False)
    save_head(same, tmp_path / "same")
    sha, saved_for = start_from_head(build_head(base, target, init_from_target=False), tmp_path / "same", target)
    assert saved_for == target.fingerprint() and len(sha) == 64


def test_an_edited_config_is_refused(tmp_path, chat_model_dir, first):
    """config.json says norm_output false (and the recipe too), the weights were saved with true."""
    import shutil

    head = shutil.copytree(first, tmp_path / "edited")
    cfg = json.loads((head / "config.json").read_text())
    cfg["norm_output"] = False
    (head / "config.json").write_text(json.dumps(cfg))
    path = _other_data_recipe(tmp_path, chat_model_dir, extra=EAGLE3 + "  norm_output: false\n")
    with pytest.raises(AssetError, match="config.json edited after saving"):
        _train(path, tmp_path, f"head.init_from={head}", out="b")


def test_a_file_or_an_empty_value_is_refused(tmp_path, chat_model_dir, first):
    from headstart.errors import ConfigError

    path = _other_data_recipe(tmp_path, chat_model_dir)
    with pytest.raises(AssetError, match="a file; name the head checkpoint's directory"):
        _train(path, tmp_path, f"head.init_from={first / 'model.safetensors'}", out="b")
    with pytest.raises(ConfigError, match="head.init_from.*empty"):
        _train(path, tmp_path, "head.init_from=", out="b")


def test_a_resume_needs_neither_the_initial_head_nor_its_path(tmp_path, chat_model_dir, first):
    """The checkpoint holds the weights and the vocabulary: a run resumes after its initial head was deleted, and
    continues exactly as the run that was not stopped; adding or dropping head.init_from is another run."""
    import shutil

    from headstart.errors import ConfigError

    # a constant rate after warmup: the run cut at 2 steps then raised to 4 follows the 4-step run's schedule
    path = _other_data_recipe(tmp_path, chat_model_dir, max_steps=2, ckpt_every_steps=1, min_lr_ratio=1.0)
    init = shutil.copytree(first, tmp_path / "init")
    _train(path, tmp_path, f"head.init_from={init}", "train.max_steps=4", out="whole")
    _train(path, tmp_path, f"head.init_from={init}", out="b")
    shutil.rmtree(init)
    with pytest.raises(ConfigError, match="started from head.init_from .*set head.init_from again"):
        _train(path, tmp_path, "train.max_steps=4", out="b", resume=True)
    _train(path, tmp_path, f"head.init_from={init}", "train.max_steps=4", out="b", resume=True)
    a = load_file(str(tmp_path / "whole" / "head-final" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "head-final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(b["d2t"], load_file(str(first / "model.safetensors"))["d2t"])
    _train(path, tmp_path, "train.max_steps=2", out="new")  # a run from a new head
    with pytest.raises(ConfigError, match="started from a new head: head.init_from does not apply"):
        _train(path, tmp_path, f"head.init_from={first}", "train.max_steps=3", out="new", resume=True)


def test_a_medusa_head_keeps_its_draft_vocabulary(tmp_path, chat_model_dir):
    """Medusa keeps d2t only (no t2d): its vocabulary is kept and its coverage counted from d2t."""
    extra = "  draft_vocab_size: 40\n  medusa_num_heads: 2\n"
    path = _recipe(tmp_path, chat_model_dir, name="m", head="medusa", extra=extra, train={"max_steps": 1})
    _train(path, tmp_path, out="m")
    start = tmp_path / "m" / "head-final"
    other = _other_data_recipe(tmp_path, chat_model_dir, extra=extra)
    other.write_text(other.read_text().replace("type: eagle3", "type: medusa"))
    _train(other, tmp_path, f"head.init_from={start}", out="b")
    after = load_file(str(tmp_path / "b" / "head-final" / "model.safetensors"))
    assert torch.equal(after["d2t"], load_file(str(start / "model.safetensors"))["d2t"])


def test_an_fp32_head_is_not_rounded_to_a_bf16_targets_dtype(tmp_path, chat_model_dir, first):
    """bf16-mixed keeps fp32 master weights: the initial head's fp32 values reach them unrounded."""
    path = _other_data_recipe(tmp_path, chat_model_dir, lr=1e-12, warmup_steps=0)
    _train(path, tmp_path, f"head.init_from={first}", "target.dtype=bf16", "trainer.precision=bf16-mixed", out="b")
    start = load_file(str(first / "model.safetensors"))
    after = load_file(str(tmp_path / "b" / "head-final" / "model.safetensors"))
    assert start["fc.weight"].dtype == torch.float32
    assert not torch.equal(start["fc.weight"], start["fc.weight"].bfloat16().float())  # not bf16 values
    assert torch.allclose(after["fc.weight"].float(), start["fc.weight"], atol=1e-8, rtol=0)
