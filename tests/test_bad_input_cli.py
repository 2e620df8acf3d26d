"""Bad input at the command line, continued (issue 34): no file of the user's is lost, nothing is
silently accepted, and a refusal is one `headstart: error:` line naming what, where and what to do."""

import json

import pytest
from conftest import fails_with_one_line

from headstart.cli import main

_fails = fails_with_one_line


def test_force_never_deletes_a_users_file_in_a_head_directory(chat_model_dir, tmp_path, capsys):
    """head init --force and import --force replace a head checkpoint, but not one the user added
    NOTES.md to: like export, they refuse and list it."""
    init = ["head", "init", "--type", "eagle3", "--model", str(chat_model_dir)]
    head = tmp_path / "h"
    assert main(init + ["--out", str(head)]) == 0
    notes = head / "NOTES.md"
    notes.write_text("my notes\n")
    _fails(capsys, init + ["--out", str(head), "--force"], "NOTES.md")
    assert notes.read_text() == "my notes\n"
    exp = tmp_path / "vllm"
    assert main(["export", str(head), "--format", "vllm", "--model", str(chat_model_dir), "--out", str(exp)]) == 0
    capsys.readouterr()
    _fails(capsys, ["import", str(exp), "--format", "vllm", "--target", str(chat_model_dir), "--out", str(head),
                    "--force"], "NOTES.md")
    assert notes.read_text() == "my notes\n"
    notes.unlink()  # a plain head checkpoint is still replaced with --force
    assert main(init + ["--out", str(head), "--force"]) == 0
    assert main(["import", str(exp), "--format", "vllm", "--target", str(chat_model_dir), "--out", str(head),
                 "--force"]) == 0


def _precompute_recipe(tmp_path, model_dir, out):
    from conftest import random_conversations, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", random_conversations(12))
    r = tmp_path / "pc.yaml"
    r.write_text(f"output_dir: {tmp_path / 'run'}\ntarget:\n  model: {model_dir}\n  dtype: fp32\ndata:\n  source: "
                 f"{data}\n  max_length: 64\nprecompute:\n  output_dir: {out}\n  shard_tokens: 400\n")
    return r


def test_precompute_never_writes_over_a_users_files(chat_model_dir, tmp_path, capsys):
    """A precompute directory without run.json that holds the user's own manifest.json (or anything
    else) is refused, listing it; the refusal leaves no lock file behind."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "manifest.json").write_text('{"mine": true}\n')
    r = _precompute_recipe(tmp_path, chat_model_dir, out)
    _fails(capsys, ["precompute", str(r)], "manifest.json")
    assert (out / "manifest.json").read_text() == '{"mine": true}\n'
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]  # no .lock-rank0, no run.json
    (out / "manifest.json").unlink()
    (out / "shard-00000.safetensors").write_bytes(b"not ours")
    _fails(capsys, ["precompute", str(r)], "shard-00000.safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.safetensors"]


def test_a_refusal_under_a_lock_leaves_no_lock_file(tmp_path):
    from headstart.errors import DataError
    from headstart.fileio import exclusive_lock

    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(DataError), exclusive_lock(mine / ".lock-rank0", what="precompute"):
        raise DataError("refused")
    assert list(mine.iterdir()) == []
    with pytest.raises(DataError), exclusive_lock(tmp_path / "new" / ".lock-rank0", what="precompute"):
        raise DataError("refused")
    assert not (tmp_path / "new").exists()
    with exclusive_lock(mine / ".lock-rank0", what="precompute"):  # a run that ends keeps its lock file
        pass
    assert [p.name for p in mine.iterdir()] == [".lock-rank0"]


def test_a_lock_file_removed_while_a_second_process_had_it_open_is_not_a_second_lock(tmp_path, monkeypatch):
    """A refused run removes the lock file it made while holding it: a process that had opened the old
    file then locks a name nobody else reaches, while a newcomer locks a new file of the same name.
    The late one must take (or be refused by) the file the name holds now."""
    import fcntl

    from headstart import fileio
    from headstart.errors import OutputError

    lock = tmp_path / ".lock-rank0"
    lock.write_text("1")
    stale = open(lock, "a+")  # opened before the first holder removed the file
    lock.unlink()
    newcomer = open(lock, "a+")
    newcomer.write("4242")
    newcomer.flush()
    fcntl.flock(newcomer, fcntl.LOCK_EX | fcntl.LOCK_NB)
    real, handed = fileio._open_lock_file, []
    monkeypatch.setattr(fileio, "_open_lock_file",
                        lambda p: handed.append(1) or (stale if len(handed) == 1 else real(p)))
    with pytest.raises(OutputError, match="already running \\(pid 4242"), fileio.exclusive_lock(lock, "precompute"):
        pass
    assert stale.closed and len(handed) == 2
    fcntl.flock(newcomer, fcntl.LOCK_UN)
    newcomer.close()


def test_regenerate_refusal_does_not_ask_for_the_flag_it_was_given(chat_model_dir, tmp_path, capsys):
    from conftest import random_conversations, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", random_conversations(6))
    r = tmp_path / "r.yaml"
    r.write_text(f"output_dir: {tmp_path / 'run'}\ntarget:\n  model: {chat_model_dir}\ndata:\n  source: {data}\n"
                 "regenerate:\n  limit: 3\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "regenerated.jsonl").write_text("")
    (tmp_path / "run" / "regenerated.jsonl.run.json").write_text(json.dumps({"limit": 3}))
    err = _fails(capsys, ["regenerate", str(r)], "pass --resume")
    err = _fails(capsys, ["regenerate", str(r), "--resume"], "regenerate.limit is 3")
    assert "pass --resume" not in err and "above 3" in err


def test_an_empty_weight_map_is_named(chat_model_dir, tmp_path, capsys):
    """An index whose weight_map is empty beside a real model.safetensors: the index is named as the
    problem, not "no weights"."""
    head = tmp_path / "h"
    assert main(["head", "init", "--type", "eagle1", "--model", str(chat_model_dir), "--out", str(head)]) == 0
    exp = tmp_path / "sg"
    assert main(["export", str(head), "--format", "sglang", "--model", str(chat_model_dir), "--out", str(exp)]) == 0
    capsys.readouterr()
    (exp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    err = _fails(capsys, ["import", str(exp), "--format", "sglang", "--target", str(chat_model_dir), "--out",
                          str(tmp_path / "i")], "weight_map is empty")
    assert "model.safetensors.index.json" in err and "no *.safetensors" not in err
    import shutil

    target = tmp_path / "target"
    shutil.copytree(chat_model_dir, target)
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    _fails(capsys, ["generate", "--model", str(target), "--prompt", "hi", "--max-tokens", "2"], "weight_map is empty")


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
SEVENTY = str(ROOT / "recipes" / "llama-3.3-70b-eagle3-8xh100.yaml")
SEVENTY_CONFIG = ROOT / "recipes" / "targets" / "llama-3.3-70b.json"


def test_plan_refuses_a_damaged_target_config_naming_the_file_and_key(tmp_path, capsys):
    good = json.loads(SEVENTY_CONFIG.read_text())
    for key, value in (("hidden_size", "big"), ("num_attention_heads", 0), ("num_hidden_layers", -30),
                       ("vocab_size", 1.5), ("intermediate_size", True), ("num_key_value_heads", 3)):
        cfg = tmp_path / f"{key}.json"
        cfg.write_text(json.dumps({**good, key: value}))
        err = _fails(capsys, ["plan", SEVENTY, "--target-config", str(cfg)], key)
        assert err.startswith(f"headstart: error: {cfg}: "), err  # the file is blamed, not the head


def test_plan_refuses_device_sizes_that_are_not_sizes(capsys):
    for gb in ("nan", "inf", "-80", "0"):
        _fails(capsys, ["plan", SEVENTY, "--target-config", str(SEVENTY_CONFIG), f"--device-memory-gb={gb}"],
               "--device-memory-gb")
    assert main(["plan", SEVENTY, "--target-config", str(SEVENTY_CONFIG), "--json"]) == 0
    json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))


def test_plan_refuses_one_rank_holding_a_tensor_parallel_shard(capsys):
    _fails(capsys, ["plan", SEVENTY, "--target-config", str(SEVENTY_CONFIG), "--set", "trainer.devices=1",
                    "--set", "trainer.num_nodes=1"], "engine.tensor_parallel 8 does not divide the training ranks")


def test_an_empty_recipe_is_refused(tmp_path, capsys):
    for text in ("", "# only a comment\n", "\n\n"):
        r = tmp_path / "empty.yaml"
        r.write_text(text)
        err = _fails(capsys, ["plan", str(r)], "empty")
        assert str(r) in err and "recipes/quickstart.yaml" in err


def test_plan_reads_the_shape_file_a_recipe_names(capsys, monkeypatch):
    """The 8xH100 recipes name their target's config.json (recipes/targets/) as target.config, so
    `plan` runs where /models/... is absent; --target-config still wins."""
    monkeypatch.chdir(ROOT)  # recipes name repository-relative paths, as the README runs them
    for recipe in ("llama-3.2-1b-eagle3", "llama-3.1-8b-eagle3", "llama-3.3-70b-eagle3", "deepseek-v2-lite-mtp"):
        assert main(["plan", f"recipes/{recipe}-8xh100.yaml"]) == 0, capsys.readouterr().err
        assert "fits: every phase" in capsys.readouterr().out
    _fails(capsys, ["plan", "recipes/llama-3.3-70b-eagle3-8xh100.yaml", "--set", "target.config=nowhere.json"],
           "target.config")


def test_a_missing_regenerated_source_says_which_verb_writes_it(tmp_path, capsys, monkeypatch):
    import shutil

    recipe = tmp_path / "r.yaml"
    shutil.copy(ROOT / "recipes" / "smollm2-135m-mtp.yaml", recipe)
    monkeypatch.chdir(tmp_path)  # a fresh checkout: runs/ holds nothing yet
    err = _fails(capsys, ["data", "inspect", str(recipe)], "headstart regenerate")
    assert "runs/smollm2-135m-mtp/regenerated.jsonl" in err
    head = tmp_path / "h"
    head.mkdir()
    (head / "config.json").write_text("{}")
    _fails(capsys, ["eval", str(recipe), "--head", str(head)], "headstart regenerate")


def test_duplicate_aux_layer_ids_are_refused_before_training_and_on_import(chat_model_dir, tmp_path, capsys):
    for kind in ("eagle3", "dflash"):
        _fails(capsys, ["train", QUICKSTART, "--set", f"head.type={kind}", "--set", "head.aux_layer_ids=[0,0,1]",
                        "--set", f"output_dir={tmp_path / kind}"], "head.aux_layer_ids")
        assert not (tmp_path / kind).exists()
    head = tmp_path / "e3"
    assert main(["head", "init", "--type", "eagle3", "--model", str(chat_model_dir), "--out", str(head)]) == 0
    exp = tmp_path / "vllm"
    assert main(["export", str(head), "--format", "vllm", "--model", str(chat_model_dir), "--out", str(exp)]) == 0
    capsys.readouterr()
    cfg = json.loads((exp / "config.json").read_text())
    for bare in (True, False):  # what vLLM reads, with and without headstart's own record beside it
        edited = {k: v for k, v in cfg.items() if not (bare and k == "headstart")}
        ids = edited["eagle_aux_hidden_state_layer_ids"]
        edited["eagle_aux_hidden_state_layer_ids"] = [ids[0]] * len(ids)
        (exp / "config.json").write_text(json.dumps(edited))
        _fails(capsys, ["import", str(exp), "--format", "vllm", "--target", str(chat_model_dir), "--out",
                        str(tmp_path / "i")], "distinct")
        assert not (tmp_path / "i").exists()
    # A speculators dflash checkpoint names its layers in aux_hidden_state_layer_ids.
    head, exp = tmp_path / "h-dflash", tmp_path / "x-dflash"
    assert main(["head", "init", "--type", "dflash", "--model", str(chat_model_dir), "--out", str(head)]) == 0
    assert main(["export", str(head), "--format", "vllm", "--model", str(chat_model_dir), "--out", str(exp)]) == 0
    capsys.readouterr()
    cfg = {k: v for k, v in json.loads((exp / "config.json").read_text()).items() if k != "headstart"}
    ids = cfg["aux_hidden_state_layer_ids"]
    (exp / "config.json").write_text(json.dumps({**cfg, "aux_hidden_state_layer_ids": [ids[0]] * len(ids)}))
    _fails(capsys, ["import", str(exp), "--format", "vllm", "--target", str(chat_model_dir), "--out",
                    str(tmp_path / "i")], "distinct")


def test_an_output_under_a_directory_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch,
                                                                                        capsys):
    """A read-only file system (root ignores permissions, so it is simulated here): the verb stops at its
    output check, naming the directory, before loading anything (eval used to fail after the whole run)."""
    import os

    from headstart import fileio
    from headstart.errors import OutputError

    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(fileio.os, "access", lambda p, mode: False if str(p) == str(ro) else real(p, mode))
    (ro / "report.json").write_text("{}")
    (ro / "outdir").mkdir()
    # new paths, an existing file (its replacement is written beside it) and an existing directory
    for out in (ro / "report", ro / "deep" / "er", ro / "report.json", ro / "outdir"):
        with pytest.raises(OutputError, match=f"{ro}: cannot be written"):
            fileio.check_output_path(out)
    (ro / "report.json").unlink()
    (ro / "outdir").rmdir()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    fails_with_one_line(capsys, ["eval", "recipes/quickstart.yaml", "--head", "assets/heads/smollm2-135m-eagle31",
                                 "--prompts", str(prompts),
                                 "--out", str(ro / "report")], f"{ro}: cannot be written")
    assert list(ro.iterdir()) == []
