"""eagle3's EAGLE-3.1 flags (norm_before_fc, fc_norm, norm_before_residual, norm_output) through every
place that reads a head's config: the defaults of a new head, a head saved before the flags existed,
the vLLM and SGLang exports and their imports (SGLang refuses the two flags it lacks), the recipe.
Semantics against speculators' own model: test_serving.py; train == engine: test_train_parts.py."""

import itertools
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import make_hf_model

from headstart.errors import AssetError
from headstart.export import export_head, import_head
from headstart.fileio import sha256_file
from headstart.heads import HeadConfig, PackedBatch, build_head, build_vocab_maps, load_head, save_head
from headstart.heads.checkpoint import CONFIG_RECORD
from headstart.heads.config import EAGLE31_DEFAULTS, EAGLE31_FLAGS
from headstart.models.llama import load_llama

# Every combination speculators accepts (norm_before_fc and fc_norm are exclusive): 12.
COMBOS = [dict(zip(EAGLE31_FLAGS, bits)) for bits in itertools.product((False, True), repeat=4) if not all(bits[:2])]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", d, seed=4)
    return load_llama(d, "fp32")


def _head(target, flags, aux=(1, 2)):
    torch.manual_seed(1)
    head = build_head(HeadConfig(head_type="eagle3", draft_vocab_size=64, aux_layer_ids=list(aux), **flags), target)
    head.set_vocab_maps(*build_vocab_maps(torch.rand(320), 64))
    with torch.no_grad():  # away from the start (norms at one would hide a norm applied twice or skipped)
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return head


def _outputs(head, target):
    """(output states, logits) of one forward and of the state fed back (the second draft step)."""
    from headstart.train.ttt import unroll

    gen = torch.Generator().manual_seed(7)
    n, d, a = 9, target.config.hidden_size, len(head.config.aux_layer_ids)
    batch = PackedBatch(torch.randint(0, 320, (n,), generator=gen), [4, 5], None,
                        torch.randn(n, a, d, generator=gen), None)
    with torch.no_grad():
        outs, _, _ = unroll(head, batch, 2)
        return [t for o in outs for t in (o, head.compute_logits(o))]


def _same(a, b, target):
    return all(torch.equal(x, y) for x, y in zip(_outputs(a, target), _outputs(b, target)))


def test_a_new_head_takes_the_trainers_defaults_and_each_flag_changes_the_head(target):
    cfg = HeadConfig(head_type="eagle3")
    assert {k: getattr(cfg, k) for k in EAGLE31_FLAGS} == EAGLE31_DEFAULTS
    assert HeadConfig(head_type="eagle3", fc_norm=True).norm_before_fc is False  # the other input norm gives way
    assert HeadConfig(head_type="mtp").norm_output is None
    with pytest.raises(ValueError, match="exclusive"):
        HeadConfig(head_type="eagle3", norm_before_fc=True, fc_norm=True)
    with pytest.raises(ValueError, match="^norm_output applies to eagle3 heads, not mtp"):
        HeadConfig(head_type="mtp", norm_output=True)
    off = dict.fromkeys(EAGLE31_FLAGS, False)
    base = _outputs(_head(target, off), target)
    for flag in EAGLE31_FLAGS:  # a flag that were ignored somewhere would leave the outputs as they were
        changed = _outputs(_head(target, off | {flag: True}), target)
        assert not torch.allclose(changed[-1], base[-1]), flag
    head = _head(target, off | {"norm_before_fc": True, "norm_output": True})
    assert head.input_norm.weight.shape == (2 * 64,)  # two aux states x d
    assert head.fc_norm is None


def test_a_head_saved_before_the_flags_loads_with_them_off(tmp_path, target):
    """An eagle3 head saved by an earlier headstart has no flag keys in config.json nor in the weights'
    config record: it loads as EAGLE-3 (all off), not with a new head's defaults."""
    old = _head(target, dict.fromkeys(EAGLE31_FLAGS, False))
    save_head(old, tmp_path / "head")
    cfg_file, weights = tmp_path / "head" / "config.json", tmp_path / "head" / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        record = json.loads(f.metadata()[CONFIG_RECORD])
    tensors = load_file(str(weights))
    for key in EAGLE31_FLAGS:
        record.pop(key)
    save_file(tensors, str(weights), metadata={CONFIG_RECORD: json.dumps(record, sort_keys=True)})
    raw = json.loads(cfg_file.read_text())
    raw = {k: v for k, v in raw.items() if k not in EAGLE31_FLAGS} | {"weights_sha256": sha256_file(weights)}
    cfg_file.write_text(json.dumps(raw))
    back = load_head(tmp_path / "head", target)
    assert not any(getattr(back.config, k) for k in EAGLE31_FLAGS)
    assert _same(back, old, target)
    raw["norm_output"] = True  # an edit after saving is still found
    cfg_file.write_text(json.dumps(raw))
    with pytest.raises(AssetError, match="norm_output"):
        load_head(tmp_path / "head", target)


@pytest.mark.parametrize("flags", COMBOS, ids=lambda f: "+".join(k for k, v in f.items() if v) or "off")
def test_every_combination_round_trips_through_vllm_and_sglang_where_it_serves(tmp_path, target, flags):
    head = _head(target, flags)
    export_head(head, target, "vllm", tmp_path / "v")
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert {k: config[k] for k in EAGLE31_FLAGS} == flags
    back = import_head(tmp_path / "v", "vllm", target, tmp_path / "vn")
    assert {k: getattr(back.config, k) for k in EAGLE31_FLAGS} == flags and _same(back, head, target)
    missing = [k for k in ("norm_before_fc", "norm_before_residual") if flags[k]]
    if missing:
        with pytest.raises(AssetError, match=f"SGLang's LlamaForCausalLMEagle3 does not implement head.{missing[0]}"):
            export_head(head, target, "sglang", tmp_path / "s")
        assert not (tmp_path / "s").exists()
        return
    export_head(head, target, "sglang", tmp_path / "s")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (flags["fc_norm"], flags["norm_output"])
    back = import_head(tmp_path / "s", "sglang", target, tmp_path / "sn")
    assert {k: getattr(back.config, k) for k in EAGLE31_FLAGS} == flags and _same(back, head, target)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_an_engine_checkpoint_is_read_as_the_engine_reads_its_flags(tmp_path, target, fmt):
    """Without our record, the flags come from the engine's own config fields (absent: off, but vLLM's
    norm_before_residual: on); an
    edited field that disagrees with our record is refused."""
    flags = {"norm_before_fc": False, "fc_norm": True, "norm_before_residual": False, "norm_output": True}
    export_head(_head(target, flags), target, fmt, tmp_path / "e")
    path = tmp_path / "e" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"norm_output": False}))
    with pytest.raises(AssetError, match="norm_output=False but the headstart record says True"):
        import_head(tmp_path / "e", fmt, target, tmp_path / "bad")
    bare = {k: v for k, v in config.items() if k not in ("headstart", "norm_output")}
    path.write_text(json.dumps(bare))
    back = import_head(tmp_path / "e", fmt, target, tmp_path / "n")
    assert back.config.fc_norm is True and back.config.norm_output is False
    assert back.config.norm_before_fc is False and back.config.norm_before_residual is False
    if fmt == "vllm":  # vLLM 0.32 serves an absent norm_before_residual as true (its speculators/algos.py)
        path.write_text(json.dumps({k: v for k, v in bare.items() if k != "norm_before_residual"}))
        assert import_head(tmp_path / "e", fmt, target, tmp_path / "n1").config.norm_before_residual is True
    path.write_text(json.dumps(bare | {"fc_norm": "yes"}))
    with pytest.raises(AssetError, match="fc_norm must be true or false"):
        import_head(tmp_path / "e", fmt, target, tmp_path / "n2")


def test_the_recipe_sets_the_flags_for_eagle3_heads_only():
    from headstart.config import HeadSection
    from headstart.heads import head_config_from_recipe

    cfg = head_config_from_recipe(HeadSection(type="eagle3", fc_norm=True, norm_output=False))
    assert (cfg.norm_before_fc, cfg.fc_norm, cfg.norm_before_residual, cfg.norm_output) == (False, True, True, False)
    for flag in EAGLE31_FLAGS:  # each flag away from its default reaches the head (a dropped one would not)
        cfg = head_config_from_recipe(HeadSection(type="eagle3", **{flag: not EAGLE31_DEFAULTS[flag]}))
        assert getattr(cfg, flag) is (not EAGLE31_DEFAULTS[flag]), flag
    with pytest.raises(ValueError, match="applies to eagle3 heads, not mtp") as e:
        HeadSection(type="mtp", norm_output=True)
    assert e.value.key == "head.norm_output"
    with pytest.raises(ValueError, match="exclusive") as e:
        HeadSection(type="eagle3", fc_norm=True, norm_before_fc=True)
    assert e.value.key == "head.fc_norm"


def test_sglangs_own_eagle3_config_is_read_as_sglang_reads_it(tmp_path, target):
    """Without our record: SGLang's legacy name `use_aux_norm` is fc_norm; norm_before_fc or
    norm_before_residual set true is refused, with or without the input_norm tensor (SGLang's
    LlamaForCausalLMEagle3 has no such norm: it would serve the head without it)."""
    flags = {"norm_before_fc": False, "fc_norm": True, "norm_before_residual": False, "norm_output": True}
    head = _head(target, flags)
    export_head(head, target, "sglang", tmp_path / "e")
    path, weights = tmp_path / "e" / "config.json", tmp_path / "e" / "model.safetensors"
    bare = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("headstart", "fc_norm")}
    path.write_text(json.dumps(bare | {"use_aux_norm": True}))
    back = import_head(tmp_path / "e", "sglang", target, tmp_path / "n")
    assert {k: getattr(back.config, k) for k in EAGLE31_FLAGS} == flags and _same(back, head, target)

    export_head(_head(target, dict.fromkeys(EAGLE31_FLAGS, False)), target, "sglang", tmp_path / "f")
    path, weights = tmp_path / "f" / "config.json", tmp_path / "f" / "model.safetensors"
    bare = {k: v for k, v in json.loads(path.read_text()).items() if k != "headstart"}
    path.write_text(json.dumps(bare | {"norm_before_fc": False, "norm_before_residual": False}))
    back = import_head(tmp_path / "f", "sglang", target, tmp_path / "n2")
    assert not any(getattr(back.config, k) for k in EAGLE31_FLAGS)
    for flag in ("norm_before_fc", "norm_before_residual"):
        path.write_text(json.dumps(bare | {flag: True}))
        with pytest.raises(AssetError, match=f"config.json: {flag} is true, but SGLang's LlamaForCausalLMEagle3 "
                                             "has no such norm.*--format vllm"):
            import_head(tmp_path / "f", "sglang", target, tmp_path / "n3")
    save_file(load_file(str(weights)) | {"input_norm.weight": torch.ones(2 * 64)}, str(weights))
    path.write_text(json.dumps(bare | {"norm_before_fc": True}))  # the tensor there too: still named by the flag
    with pytest.raises(AssetError, match="norm_before_fc is true, but SGLang's LlamaForCausalLMEagle3 has no such"):
        import_head(tmp_path / "f", "sglang", target, tmp_path / "n3")
    path.write_text(json.dumps(bare | {"norm_before_residual": "yes"}))
    with pytest.raises(AssetError, match="norm_before_residual must be true or false, got 'yes'"):
        import_head(tmp_path / "f", "sglang", target, tmp_path / "n3")
    n = target.config.num_hidden_layers
    for ids in ([-1, 0], [1, 0], [0, n]):  # named in SGLang's own numbers (the layer whose output it captures)
        path.write_text(json.dumps(bare | {"eagle_config": {**bare["eagle_config"],
                                                            "eagle_aux_hidden_state_layer_ids": ids}}))
        with pytest.raises(AssetError, match=re.escape(f"eagle_aux_hidden_state_layer_ids {ids} must be distinct, "
                                                       f"ascending layer ids in 0..{n - 1}")):
            import_head(tmp_path / "f", "sglang", target, tmp_path / "n3")
    assert not (tmp_path / "n3").exists()


def test_an_export_that_feeds_back_another_state_is_refused(tmp_path, target, monkeypatch):
    """The export check compares the output states too: a read-back head that lost norm_output gives
    the same logits (its lm_head reads norm(y) either way) but feeds y, not norm(y), to the next step."""
    import headstart.export as export

    head, read = _head(target, dict.fromkeys(EAGLE31_FLAGS, False) | {"norm_output": True}), []
    real = export._read_back

    def losing_norm_output(*args, **kwargs):
        back = real(*args, **kwargs)
        back.config.norm_output = False
        read.append(back)
        return back

    monkeypatch.setattr(export, "_read_back", losing_norm_output)
    with pytest.raises(AssetError, match="export as vllm: the checkpoint read back gives other"):
        export_head(head, target, "vllm", tmp_path / "v")
    assert not (tmp_path / "v").exists()
    mine, back = _outputs(head, target), _outputs(read[0], target)
    assert torch.equal(mine[1], back[1]) and not torch.equal(mine[0], back[0])  # first step: same logits only


def test_a_flag_of_the_wrong_type_is_named_plainly(tmp_path, target):
    """An eagle3 flag must be a boolean: the message names the key as config.json spells it, and a
    null in a saved head's config.json is refused, not read as a new head's default."""
    with pytest.raises(ValueError, match="^norm_output must be true or false, got 'yes'$"):
        HeadConfig(head_type="eagle3", norm_output="yes")
    save_head(_head(target, dict.fromkeys(EAGLE31_FLAGS, False)), tmp_path / "head")
    cfg_file = tmp_path / "head" / "config.json"
    raw = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps(raw | {"norm_output": None}))
    with pytest.raises(AssetError, match=r"config.json: norm_output must be true or false, got null$"):
        load_head(tmp_path / "head", target)


def test_head_init_sets_the_flags_on_eagle3_heads_only(tmp_path, chat_model_dir, capsys):
    """`head init --type eagle3` takes the trainer's defaults unless told: --no-norm-before-fc
    --no-norm-before-residual makes a head SGLang serves."""
    from headstart.cli import main
    from headstart.export.sglang import SGLANG_MISSING_FLAGS
    from headstart.heads import read_head_config

    def init(*argv):
        return main(["head", "init", "--model", str(chat_model_dir), *argv])

    def flags(path):
        return {k: getattr(read_head_config(path), k) for k in EAGLE31_FLAGS}

    assert init("--type", "eagle3", "--out", str(tmp_path / "new")) == 0
    assert flags(tmp_path / "new") == EAGLE31_DEFAULTS
    sglang = ["--no-norm-before-fc", "--no-norm-before-residual"]
    assert init("--type", "eagle3", *sglang, "--out", str(tmp_path / "s")) == 0
    assert flags(tmp_path / "s") == {"norm_before_fc": False, "fc_norm": False, "norm_before_residual": False,
                                     "norm_output": True}
    assert not any(flags(tmp_path / "s")[k] for k in SGLANG_MISSING_FLAGS)
    assert init("--type", "eagle3", "--fc-norm", "--no-norm-output", "--out", str(tmp_path / "f")) == 0
    assert flags(tmp_path / "f") == {"norm_before_fc": False, "fc_norm": True, "norm_before_residual": True,
                                     "norm_output": False}
    capsys.readouterr()
    assert init("--type", "mtp", "--no-norm-output", "--out", str(tmp_path / "m")) == 2
    assert "--no-norm-output applies to eagle3 heads, not mtp" in capsys.readouterr().err
    assert init("--type", "eagle3", "--norm-before-fc", "--fc-norm", "--out", str(tmp_path / "x")) == 2
    assert "norm_before_fc and fc_norm are exclusive" in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "x").exists()
    for flag in ("norm-before-fc", "fc-bias"):  # both ways on one line: an error, not the last one winning
        with pytest.raises(SystemExit) as e:
            init("--type", "eagle3", f"--{flag}", f"--no-{flag}", "--out", str(tmp_path / "y"))
        assert e.value.code == 2 and f"--{flag} and --no-{flag} contradict each other" in capsys.readouterr().err
    assert init("--type", "eagle1", "--no-fc-bias", "--out", str(tmp_path / "e1")) == 0
    assert read_head_config(tmp_path / "e1").fc_bias is False
    assert init("--type", "mtp", "--no-fc-bias", "--out", str(tmp_path / "m2")) == 2
    assert "--no-fc-bias applies to eagle1 heads, not mtp" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
