from pathlib import Path

import pytest

from headstart.config import Recipe
from headstart.errors import ConfigError
from headstart.recipe_io import load_recipe, recipe_from_dict

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert any(p.name == "smollm2-135m-mtp.yaml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_parses(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    assert recipe.target.model and recipe.data.source and recipe.output_dir


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    p = _write(tmp_path, "data:\n  max_lenght: 10\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert str(p) in msg and "data.max_lenght" in msg and "data.max_length" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trainers'; did you mean 'trainer'"):
        load_recipe(_write(tmp_path, "trainers: {}\n"))


def test_wrong_type_names_key_and_file(tmp_path):
    p = _write(tmp_path, "data:\n  max_length: long\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(p)
    assert str(p) in str(e.value) and "'data.max_length' must be int" in str(e.value)


def test_bool_is_not_an_int_and_int_is_a_float(tmp_path):
    with pytest.raises(ConfigError, match="data.limit"):
        load_recipe(_write(tmp_path, "data:\n  limit: true\n"))
    assert load_recipe(_write(tmp_path, "data:\n  heldout_fraction: 0\n")).data.heldout_fraction == 0.0


def test_literal_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"'target.dtype' must be one of \['auto', 'bf16', 'fp16', 'fp32'\]"):
        load_recipe(_write(tmp_path, "target:\n  dtype: float8\n"))


def test_value_checks_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"'data.heldout_fraction' must be in \[0, 1\)"):
        load_recipe(_write(tmp_path, "data:\n  heldout_fraction: 1.5\n"))
    with pytest.raises(ConfigError, match="'data.limit' must be > 0"):
        load_recipe(_write(tmp_path, "data:\n  limit: 0\n"))
    for key in ("epochs", "max_sequences"):
        with pytest.raises(ConfigError, match=f"'train.{key}' must be >= 1 or null"):
            load_recipe(_write(tmp_path, f"train:\n  {key}: 0\n"))
    with pytest.raises(ConfigError, match="'head.postnorm_features' applies to mtp, eagle1 and deepseek_mtp"):
        load_recipe(_write(tmp_path, "head:\n  type: eagle3\n  postnorm_features: true\n"))
    ok = load_recipe(_write(tmp_path, "head:\n  type: deepseek_mtp\n  postnorm_features: true\n"))
    assert ok.head.postnorm_features
    with pytest.raises(ConfigError, match="'head.fc_bias' applies to eagle1 heads, not mtp"):
        load_recipe(_write(tmp_path, "head:\n  type: mtp\n  fc_bias: false\n"))
    from headstart.heads import head_config_from_recipe

    e1 = load_recipe(_write(tmp_path, "head:\n  type: eagle1\n  fc_bias: false\n"))
    assert head_config_from_recipe(e1.head).fc_bias is False  # vLLM's EAGLE-1 drafter has no fc bias


def test_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="'data' must be a mapping"):
        load_recipe(_write(tmp_path, "data: sharegpt\n"))


def test_not_yaml_and_missing(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(_write(tmp_path, "data: [1, 2\n"))
    with pytest.raises(ConfigError, match="recipe not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_set_overrides_are_typed(tmp_path):
    p = _write(tmp_path, "data:\n  limit: 10\n")
    r = load_recipe(p, ["data.limit=200", "data.heldout_fraction=0.1", "target.model=/some/dir", "seed=3"])
    assert r.data.limit == 200 and r.data.heldout_fraction == 0.1
    assert r.target.model == "/some/dir" and r.seed == 3
    assert load_recipe(p, ["data.limit=null"]).data.limit is None


def test_set_errors_say_set(tmp_path):
    p = _write(tmp_path, "{}\n")
    with pytest.raises(ConfigError, match=r"--set data.limt.*did you mean 'data.limit'"):
        load_recipe(p, ["data.limt=3"])
    with pytest.raises(ConfigError, match=r"--set data.max_length: 'data.max_length' must be int"):
        load_recipe(p, ["data.max_length=abc"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_recipe(p, ["data.limit"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_recipe(p, ["seed.x=1"])


def test_defaults_and_round_trip():
    r = recipe_from_dict({})
    assert recipe_from_dict(r.to_dict()) == r


def test_a_yaml_alias_bomb_is_a_short_error(tmp_path):
    rows = ['  - &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, cur in zip("abcdefg", "bcdefgh"):
        rows.append(f"  - &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    p = _write(tmp_path, "name:\n" + "\n".join(rows) + "\n")  # 9^8 strings if expanded
    with pytest.raises(ConfigError) as e:
        load_recipe(p)
    assert "'name' must be str" in str(e.value) and len(str(e.value)) < 400


def test_long_bad_values_are_cut_in_messages(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_recipe(_write(tmp_path, f"target:\n  dtype: {'q' * 100_000}\n"))
    assert len(str(e.value)) < 400
    with pytest.raises(ConfigError) as e:
        load_recipe(_write(tmp_path, f"{'k' * 100_000}: 1\n"))
    assert len(str(e.value)) < 600


def test_set_values_are_coerced_bounded_and_named():
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-mtp.yaml"
    assert load_recipe(recipe, ["train.lr=1e-4"]).train.lr == 1e-4  # YAML 1.1 reads this as a string
    with pytest.raises(ConfigError, match=r"--set train.lr: 'train.lr' must be float, got str 'fast'"):
        load_recipe(recipe, ["train.lr=fast"])
    with pytest.raises(ConfigError, match=r"^--set train.ttt_steps: 'train.ttt_steps' must be in 1..16, got 100"):
        load_recipe(recipe, ["train.ttt_steps=100"])
    for key in ("warmup_steps", "grad_clip", "val_prompts"):
        with pytest.raises(ConfigError, match=rf"^--set train.{key}: 'train.{key}' must be >= 0"):
            load_recipe(recipe, [f"train.{key}=-1"])
