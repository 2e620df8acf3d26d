"""What `headstart train` may write into, checked before the target loads: a user's train.json, a
second run on the same output_dir, symbolic links, a resume that would train nothing, damaged
checkpoints, crash leftovers, a full disk; and the closing line names only heads that exist."""

import errno
import json
import os
import pickle
import zipfile

import pytest
from test_train import _recipe

from headstart.cli import main
from headstart.fileio import exclusive_lock
from headstart.train.outputs import lock_path

QUICK = {"max_steps": 2, "val_every_steps": 0, "val_prompts": 1, "ckpt_every_steps": 1}


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the target is loaded: these refusals must come first."""
    import headstart.models.llama as llama

    def load(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(llama, "load_llama", load)


def _fails(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and err.count("headstart: error:") == 1, err
    return err


def test_a_users_files_in_output_dir_are_refused_before_the_model_loads(tmp_path, chat_model_dir, capsys, no_model):
    path = _recipe(tmp_path, chat_model_dir, train=QUICK)
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.json").write_text('[{"prompt": "my dataset"}]\n')
    argv = ["train", str(path), "--no-progress"]
    _fails(capsys, argv, f"{out / 'train.json'}: is not a headstart training record")
    assert (out / "train.json").read_text() == '[{"prompt": "my dataset"}]\n'
    (out / "train.json").unlink()
    (out / "notes.md").write_text("mine")
    _fails(capsys, argv, "holds notes.md that no training run of headstart wrote")
    assert sorted(p.name for p in out.iterdir()) == ["notes.md"]


def test_precompute_and_earlier_runs_are_recognised(tmp_path, chat_model_dir):
    from headstart.recipe_io import load_recipe
    from headstart.train.outputs import FORMAT, check_output_dir

    recipe = load_recipe(_recipe(tmp_path, chat_model_dir, train=QUICK))
    out = tmp_path / "run"
    (out / "precompute").mkdir(parents=True)
    (out / "precompute" / "run.json").write_text(json.dumps({"format": "headstart-precompute/1"}))
    (out / "regenerated.jsonl").write_text("{}\n")
    (out / "regenerated.jsonl.run.json").write_text("{}")  # regenerate's provenance record beside it
    assert check_output_dir(recipe, resume=False) == out.resolve()
    (out / "precompute" / "run.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(Exception, match="holds precompute that no training run"):
        check_output_dir(recipe, resume=False)
    (out / "train.json").write_text(json.dumps({"format": FORMAT}))
    assert check_output_dir(recipe, resume=False) == out.resolve()


def test_a_second_run_on_the_same_output_dir_refuses_naming_the_holder(tmp_path, chat_model_dir, capsys, no_model):
    path = _recipe(tmp_path, chat_model_dir, train=QUICK)
    out = tmp_path / "run"
    with exclusive_lock(lock_path(out.resolve(), 0), what="a first run"):
        _fails(capsys, ["train", str(path), "--no-progress"], f"already running (pid {os.getpid()}")


@pytest.mark.parametrize("name", ["checkpoints", "head-best", "head-final"])
def test_a_symlinked_subdirectory_is_refused(tmp_path, chat_model_dir, capsys, no_model, name):
    path = _recipe(tmp_path, chat_model_dir, train=QUICK)
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / name).symlink_to(elsewhere)
    _fails(capsys, ["train", str(path), "--no-progress"], f"{out / name}: is a symbolic link")
    assert not any(elsewhere.iterdir())


def test_an_output_dir_that_cannot_be_created_is_one_line(tmp_path, chat_model_dir, capsys, no_model):
    path = _recipe(tmp_path, chat_model_dir, train=QUICK)
    _fails(capsys, ["train", str(path), "--no-progress", "--set", "output_dir=/proc/headstart-run"],
           "cannot be written")


def test_resume_refusals_leftovers_and_the_closing_line(tmp_path, chat_model_dir, capsys):
    path = _recipe(tmp_path, chat_model_dir, train={**QUICK, "val_prompts": 0})
    out = tmp_path / "run"
    assert main(["train", str(path), "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    assert f"{out}/head-final" in stdout and "head-best" not in stdout  # no validation: no best head
    last = out / "checkpoints" / "last.ckpt"
    good = last.read_bytes()
    argv = ["train", str(path), "--no-progress", "--resume"]
    _fails(capsys, argv, f"{last} is at step 2 and train.max_steps is 2")
    with zipfile.ZipFile(last, "w") as z:  # a zip, but not a Lightning checkpoint
        z.writestr("archive/data.pkl", b"junk")
    _fails(capsys, argv + ["--set", "train.max_steps=3"], f"{last}: damaged or not a headstart training checkpoint")
    last.write_bytes(pickle.dumps({"global_step": 2}))
    err = _fails(capsys, argv + ["--set", "train.max_steps=3"], f"{last}: damaged")
    assert "weights_only" not in err
    last.write_bytes(good)
    stale = out / "checkpoints" / ".last.ckpt.tmp-999999999"  # a killed run's temporary: no such pid
    stale.write_bytes(b"x" * 100)
    assert main(argv + ["--set", "train.max_steps=3"]) == 0
    assert not stale.exists()


def test_a_full_disk_during_a_checkpoint_is_one_line(tmp_path, chat_model_dir, capsys, monkeypatch):
    import lightning as L

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(L.Trainer, "save_checkpoint", full)
    path = _recipe(tmp_path, chat_model_dir, train=QUICK)
    _fails(capsys, ["train", str(path), "--no-progress"], "the checkpoint cannot be written (No space left on device)")
    assert not list((tmp_path / "run").glob("**/.*tmp*"))


def test_a_resume_refusal_shows_where_two_long_values_differ(tmp_path):
    from headstart.errors import ConfigError
    from headstart.train.outputs import check_resume

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.ckpt").write_bytes(b"")
    start = "runs/smollm2-135m-eagle31-first/checkpoints/"
    old = {"target_fingerprint": "t" * 64, "data_fingerprint": "d" * 20,
           "recipe": {"head.init_from": start + "head-final", "train.lr": 0.001}}
    (out / "train.json").write_text(json.dumps(old))
    new = {**old, "recipe": {**old["recipe"], "head.init_from": start + "head-best"}}
    with pytest.raises(ConfigError) as e:
        check_resume(out, new, resume=True)
    assert "head-final" in str(e.value) and "head-best" in str(e.value)  # not two equal 40-character cuts
    assert "train.lr" not in str(e.value)
