"""Shards are the recipe's own training split: a run from shards of other data (another source, limit,
max_length or max_turns) or of another split (held-out fraction, split key, precompute.split heldout or all) is refused
by name before any step, so no run trains on data its recipe does not describe or validates on rows it trained on."""

import json
import shutil

import pytest
from conftest import random_conversations, write_jsonl
from test_train import _recipe

from headstart.cli import main
from headstart.errors import DataError
from headstart.recipe_io import load_recipe


@pytest.fixture
def shards(tmp_path, chat_model_dir):
    path = _recipe(tmp_path, chat_model_dir, name="s", train={"source": "shards", "max_steps": 1})
    assert main(["precompute", str(path)]) == 0
    return path, tmp_path / "s" / "precompute"


def _train(path, tmp_path, *sets, out="o", resume=False):
    from headstart.train import run_train

    return run_train(load_recipe(path, [*sets, f"output_dir={tmp_path / out}"]), resume=resume, progress=False)


@pytest.mark.parametrize("change", ["data.max_length=64", "data.limit=20", "data.max_turns=1"])
def test_shards_of_other_data_are_refused(tmp_path, shards, change):
    path, made = shards
    with pytest.raises(DataError, match=r"precompute.*other data.*data section"):
        _train(path, tmp_path, change, f"train.shards_dir={made}")
    assert not (tmp_path / "o").exists()


def test_shards_of_the_same_data_under_another_output_dir_train(tmp_path, shards):
    path, made = shards
    _train(path, tmp_path, f"train.shards_dir={made}")
    assert (tmp_path / "o" / "head-final").is_dir()


# the split: shards of another held-out fraction, split key or split would train on held-out rows

def test_shards_of_another_heldout_fraction_are_refused(tmp_path, shards):
    """Shards of the training split at heldout_fraction 0.15 hold conversations that are held out at 0.5:
    the run would validate (val_loss, tau, head-best) on sequences it trained on."""
    from headstart.data.dataset import build_dataset

    path, made = shards
    recipe = load_recipe(path, ["data.heldout_fraction=0.5"])
    held = set(build_dataset(recipe.data, recipe.target.model, progress=False).heldout["id"])
    trained = set(build_dataset(load_recipe(path).data, recipe.target.model, progress=False).train["id"])
    assert held & trained  # the overlap is real
    with pytest.raises(DataError, match="not this recipe's training split"):
        _train(path, tmp_path, "data.heldout_fraction=0.5", f"train.shards_dir={made}")
    assert not (tmp_path / "o").exists()


def test_shards_of_another_split_key_are_refused(tmp_path, chat_model_dir):
    rows = random_conversations(48, 0, max_rounds=2, user_words=(2, 10), reply_words=(4, 24))
    for i, r in enumerate(rows):
        r["id"] = f"c{i // 4}_{i % 4}"  # four pieces per chat: id_prefix keeps a chat on one side
    write_jsonl(tmp_path / "k.jsonl", rows)
    path = _recipe(tmp_path, chat_model_dir, name="k", train={"source": "shards", "max_steps": 1})
    assert main(["precompute", str(path)]) == 0  # split_key: id
    with pytest.raises(DataError, match="not this recipe's training split"):
        _train(path, tmp_path, "data.split_key=id_prefix", f"train.shards_dir={tmp_path / 'k' / 'precompute'}")


def test_shards_of_the_heldout_split_are_refused(tmp_path, shards):
    """precompute.split: heldout shards have the recipe's own dataset fingerprint: training on them is
    training on exactly the split the run validates on."""
    path, _ = shards
    assert main(["precompute", str(path), "--set", "precompute.split=heldout",
                 "--set", f"precompute.output_dir={tmp_path / 'h'}"]) == 0
    with pytest.raises(DataError, match="shards hold split heldout"):
        _train(path, tmp_path, f"train.shards_dir={tmp_path / 'h'}")


def test_shards_of_another_source_content_are_refused(tmp_path, shards):
    path, made = shards
    other = tmp_path / "other.jsonl"
    write_jsonl(other, random_conversations(48, 7, max_rounds=2, user_words=(2, 10), reply_words=(4, 24)))
    with pytest.raises(DataError, match="other data"):
        _train(path, tmp_path, f"data.source={other}", f"train.shards_dir={made}")


def test_the_recipes_own_precompute_dir_is_checked_too(tmp_path, shards):
    path, _ = shards  # no train.shards_dir: <output_dir>/precompute of the recipe
    with pytest.raises(DataError, match="other data"):
        _train(path, tmp_path, "data.max_length=64", f"precompute.output_dir={tmp_path / 's' / 'precompute'}")


def test_a_manifest_without_a_dataset_fingerprint_is_refused(tmp_path, shards):
    path, made = shards
    old = tmp_path / "old"
    shutil.copytree(made, old)
    m = json.loads((old / "manifest.json").read_text())
    del m["fingerprints"]["dataset"]
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="no dataset fingerprint in its manifest"):
        _train(path, tmp_path, f"train.shards_dir={old}")


# legitimate flows keep training

def test_the_same_content_at_another_absolute_path_trains(tmp_path, shards):
    """The benchmarks point data.source at a resolved (or copied) path: the fingerprint is the content's."""
    path, made = shards
    copy = tmp_path / "elsewhere" / "copy.jsonl"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "s.jsonl", copy)
    _train(path, tmp_path, f"data.source={copy}", f"train.shards_dir={made}")
    assert (tmp_path / "o" / "head-final").is_dir()


def test_fp8_shards_and_a_resumed_run_still_train_and_split_all_is_refused(tmp_path, shards):
    path, _ = shards
    assert main(["precompute", str(path), "--set", "precompute.storage=fp8",
                 "--set", f"precompute.output_dir={tmp_path / 'f8'}"]) == 0
    _train(path, tmp_path, f"train.shards_dir={tmp_path / 'f8'}", out="o8")
    sets = [f"train.shards_dir={tmp_path / 's' / 'precompute'}", "train.ckpt_every_steps=1", "train.min_lr_ratio=1.0"]
    _train(path, tmp_path, *sets, "train.max_steps=2", out="r")
    _train(path, tmp_path, *sets, "train.max_steps=3", out="r", resume=True)
    assert json.loads((tmp_path / "r" / "metrics.json").read_text())["step"] == 3
    assert main(["precompute", str(path), "--set", "precompute.split=all",
                 "--set", f"precompute.output_dir={tmp_path / 'all'}"]) == 0
    with pytest.raises(DataError, match="shards hold split all"):  # the held-out rows too
        _train(path, tmp_path, f"train.shards_dir={tmp_path / 'all'}", out="oa")
