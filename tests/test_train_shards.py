"""Shards are the recipe's own data: a training run from shards of other data (another source, limit,
max_length or max_turns) is refused by name before any step, so no run trains on data its recipe does not
describe (its held-out split is the recipe's)."""

import pytest
from test_train import _recipe

from headstart.cli import main
from headstart.errors import DataError
from headstart.recipe_io import load_recipe


@pytest.fixture
def shards(tmp_path, chat_model_dir):
    path = _recipe(tmp_path, chat_model_dir, name="s", train={"source": "shards", "max_steps": 1})
    assert main(["precompute", str(path)]) == 0
    return path, tmp_path / "s" / "precompute"


@pytest.mark.parametrize("change", ["data.max_length=64", "data.limit=20", "data.max_turns=1"])
def test_shards_of_other_data_are_refused(tmp_path, shards, change):
    from headstart.train import run_train

    path, made = shards
    recipe = load_recipe(path, [change, f"output_dir={tmp_path / 'o'}", f"train.shards_dir={made}"])
    with pytest.raises(DataError, match=r"precompute.*other data.*data section"):
        run_train(recipe, progress=False)
    assert not (tmp_path / "o").exists()


def test_shards_of_the_same_data_under_another_output_dir_train(tmp_path, shards):
    from headstart.train import run_train

    path, made = shards
    run_train(load_recipe(path, [f"output_dir={tmp_path / 'o'}", f"train.shards_dir={made}"]), progress=False)
    assert (tmp_path / "o" / "head-final").is_dir()
