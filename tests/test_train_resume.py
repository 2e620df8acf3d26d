"""`headstart train --resume` on a tiny random target: a SIGKILLed run resumed equals an uninterrupted
one, a changed recipe is refused naming the difference, gradient accumulation resumes on its optimizer
step, and FSDP's sharded checkpoint resumes onto the same ranks (the rest of `train`: test_train.py)."""

import json
import logging
import signal
import time

import pytest
import torch
from test_train import _cli, _curve, _losses, _recipe, _same_heads, _torchrun

from headstart.cli import main
from headstart.errors import DataError
from headstart.heads import load_head
from headstart.models.llama import load_llama


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, chat_model_dir):
    train = {"max_steps": 12, "val_every_steps": 0, "ckpt_every_steps": 3, "val_prompts": 1}
    ref = _recipe(tmp_path, chat_model_dir, name="ref", train=train)
    p = _cli(["train", str(ref), "--no-progress"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    killed = _recipe(tmp_path, chat_model_dir, name="killed", train=train)
    out = tmp_path / "killed"
    proc = _cli(["train", str(killed), "--no-progress"])
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        logged = _losses(out) if (out / "metrics.csv").exists() else {}
        if (out / "checkpoints" / "last.ckpt").exists() and len(logged) >= 4:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _losses(out)
    assert 3 <= len(done) < 12, "the run was not interrupted mid-way"
    assert _cli(["train", str(killed), "--no-progress"]).wait() != 0  # without --resume: refused
    p = _cli(["train", str(killed), "--no-progress", "--resume"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    a, b = _losses(tmp_path / "ref"), _losses(out)
    assert list(b) == list(range(1, 13))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step


def test_resume_with_another_recipe_is_refused_naming_the_difference(tmp_path, chat_model_dir, capsys):
    path = _recipe(tmp_path, chat_model_dir, train={"max_steps": 2, "val_every_steps": 0})
    assert main(["train", str(path), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", str(path), "--no-progress", "--resume", "--set", "train.lr=0.01",
                 "--set", "train.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "train.lr" in err and "Traceback" not in err
    assert main(["train", str(path), "--no-progress", "--resume", "--set", "train.max_sequences=5",
                 "--set", "train.max_steps=3"]) == 2
    assert "train.max_sequences (None -> 5)" in capsys.readouterr().err  # another data order under the same skip
    # A run recorded before a key existed ran as its default: only another value is a difference.
    info = tmp_path / "run" / "train.json"
    record = json.loads(info.read_text())
    del record["recipe"]["train.max_sequences"]
    info.write_text(json.dumps(record))
    assert main(["train", str(path), "--no-progress", "--resume", "--set", "train.max_sequences=5",
                 "--set", "train.max_steps=3"]) == 2
    assert "train.max_sequences (None -> 5)" in capsys.readouterr().err
    assert main(["train", str(path), "--no-progress", "--resume", "--set", "train.max_steps=3"]) == 0  # longer: fine


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_resume_with_accumulation_continues_exactly(tmp_path, chat_model_dir):
    """Checkpoints land on optimizer-step boundaries: stopping after step 2 of 4 (grad_accum 2) and
    resuming gives the same losses and head as one run (constant lr, so the schedule is the same)."""
    train = {"max_steps": 4, "grad_accum": 2, "ckpt_every_steps": 1, "val_every_steps": 0, "val_prompts": 1,
             "warmup_steps": 0, "min_lr_ratio": 1.0}
    one = _recipe(tmp_path, chat_model_dir, name="one", train=train)
    said = _Lines()  # Lightning's own logger may not propagate to the root: listen to it directly
    logging.getLogger("lightning.pytorch").addHandler(said)
    try:
        assert main(["train", str(one), "--no-progress"]) == 0
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(said)
    # Four checkpoints, and no line per checkpoint about a save option the run sets itself.
    assert any("GPU available" in m for m in said.lines), said.lines  # the handler hears Lightning
    assert not [m for m in said.lines if "weights_only" in m], said.lines
    two = _recipe(tmp_path, chat_model_dir, name="two", train=train)
    assert main(["train", str(two), "--no-progress", "--set", "train.max_steps=2"]) == 0
    assert main(["train", str(two), "--no-progress", "--resume"]) == 0
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert list(b) == [1, 2, 3, 4] and b == pytest.approx(a, rel=1e-6)
    ta = load_head(tmp_path / "one" / "head-final", load_llama(chat_model_dir, "fp32")).state_dict()
    tb = load_head(tmp_path / "two" / "head-final", load_llama(chat_model_dir, "fp32")).state_dict()
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=0, atol=0)
    vals = [int(r["step"]) for r in _curve(tmp_path / "two") if r["kind"] == "val"]
    assert vals == [2, 4]  # the resumed step is not validated twice


def test_fsdp_on_two_gloo_ranks_equals_one_process_and_resumes_sharded(tmp_path, chat_model_dir, capsys):
    """trainer.strategy fsdp: FSDP2 (fully_shard per layer and per projection) over 2 gloo ranks. The
    head after 3 steps, validation included (on the gathered head), equals one process accumulating
    the two micro-batches; a run stopped at step 2 leaves a directory of shards that resumes to the
    same head; resuming onto another number of ranks is refused, naming both."""
    # A constant rate after warmup: the run cut at max_steps 2 then raised to 3 follows the same schedule.
    train = {"max_steps": 3, "val_every_steps": 3, "val_prompts": 2, "ckpt_every_steps": 1, "min_lr_ratio": 1.0}
    one = _recipe(tmp_path, chat_model_dir, name="one", train={**train, "grad_accum": 2}, n=64)
    p = _cli(["train", str(one), "--no-progress"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    fsdp = ["--set", "trainer.devices=2", "--set", "trainer.accelerator=cpu", "--set", "trainer.strategy=fsdp"]
    two = _recipe(tmp_path, chat_model_dir, name="two", train=train, n=64)
    p = _torchrun(2, ["train", str(two), "--no-progress", *fsdp])  # FSDP ranks come from torchrun
    _, err = p.communicate(timeout=900)
    assert p.returncode == 0, err.decode()[-3000:]
    _same_heads(tmp_path / "one", tmp_path / "two", chat_model_dir)
    ma, mb = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("one", "two"))
    assert mb["val_loss"] == pytest.approx(ma["val_loss"], rel=1e-4) and mb["tau"] == ma["tau"]
    ckpt = tmp_path / "two" / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2

    cut = _recipe(tmp_path, chat_model_dir, name="cut", train={**train, "max_steps": 2}, n=64)
    p = _torchrun(2, ["train", str(cut), "--no-progress", *fsdp])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    assert main(["train", str(cut), "--no-progress", "--resume", "--set", "train.max_steps=3",
                 "--set", "trainer.accelerator=cpu", "--set", "trainer.strategy=fsdp"]) == 2
    err = capsys.readouterr().err
    assert "trained on 2 ranks" in err and "has 1" in err and "Traceback" not in err
    assert main(["train", str(cut), "--no-progress", "--resume", "--set", "train.max_steps=3", "--set",
                 "trainer.accelerator=cpu", "--set", "trainer.devices=2", "--set", "trainer.strategy=ddp"]) == 2
    err = capsys.readouterr().err
    assert "resolved.checkpoint ('sharded' -> 'file')" in err and "Traceback" not in err
    import shutil

    from headstart.train.outputs import checkpoint_step

    ckpt = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert checkpoint_step(ckpt) == 2
    for damage, named in (("truncate", "is cut short"), ("delete", "is missing")):
        bad = tmp_path / f"bad-{damage}"
        shutil.copytree(ckpt, bad)
        shard = sorted(bad.glob("*.distcp"))[1]
        if damage == "truncate":
            shard.write_bytes(shard.read_bytes()[:100])
        else:
            shard.unlink()
        with pytest.raises(DataError, match=f"the shard {shard.name} {named}"):
            checkpoint_step(bad)
    p = _torchrun(2, ["train", str(cut), "--no-progress", "--resume", "--set", "train.max_steps=3", *fsdp])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    _same_heads(tmp_path / "two", tmp_path / "cut", chat_model_dir)


def test_a_time_boxed_run_stops_on_a_step_with_a_checkpoint_and_resumes_exactly(tmp_path, chat_model_dir, capsys):
    """train --minutes: past the time box the run checkpoints the optimizer step it is on (grad_accum 2:
    never between micro-batches) and stops cleanly, without a validation of its own or head-final; --resume
    then ends it as one run would: the same losses, validations at the same steps, the same head."""
    train = {"max_steps": 5, "grad_accum": 2, "ckpt_every_steps": 4, "val_every_steps": 2, "val_prompts": 1}
    one = _recipe(tmp_path, chat_model_dir, name="one", train=train)
    assert main(["train", str(one), "--no-progress"]) == 0
    two = _recipe(tmp_path, chat_model_dir, name="two", train=train)
    out = tmp_path / "two"
    capsys.readouterr()
    assert main(["train", str(two), "--no-progress", "--minutes", "0"]) == 2
    assert "--minutes 0.0: must be > 0" in capsys.readouterr().err
    assert main(["train", str(two), "--no-progress", "--minutes", "1e-9"]) == 0  # up before the first step ends
    err = capsys.readouterr().err
    assert "stopped at step 1 of 5 (--minutes)" in err and "rerun with --resume" in err
    assert (out / "checkpoints" / "last.ckpt").is_file() and not (out / "head-final").exists()
    assert list(_losses(out)) == [1] and not [r for r in _curve(out) if r["kind"] == "val"]
    assert main(["train", str(two), "--no-progress", "--resume", "--minutes", "1e-9"]) == 0  # step 2, validated
    assert "stopped at step 2 of 5" in capsys.readouterr().err
    assert main(["train", str(two), "--no-progress", "--resume"]) == 0
    a, b = _losses(tmp_path / "one"), _losses(out)
    assert list(b) == [1, 2, 3, 4, 5] and b == pytest.approx(a, rel=1e-6)
    assert [int(r["step"]) for r in _curve(out) if r["kind"] == "val"] == [2, 4, 5]
    ta = load_head(tmp_path / "one" / "head-final", load_llama(chat_model_dir, "fp32")).state_dict()
    tb = load_head(out / "head-final", load_llama(chat_model_dir, "fp32")).state_dict()
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=0, atol=0)


def test_a_time_boxed_run_on_two_gloo_ranks_stops_both_on_one_step(tmp_path, chat_model_dir):
    """Rank 0's clock decides for both ranks (a rank stopping alone would leave the other waiting in its
    gradient all-reduce): both stop at step 1, and --resume on two ranks ends the run."""
    two = _recipe(tmp_path, chat_model_dir, train={"max_steps": 3, "val_every_steps": 0, "val_prompts": 1}, n=64)
    ranks = ["--set", "trainer.devices=2", "--set", "trainer.accelerator=cpu"]
    p = _cli(["train", str(two), "--no-progress", *ranks, "--minutes", "1e-9"])
    assert p.wait(timeout=600) == 0
    assert "stopped at step 1 of 3 (--minutes)" in p.stderr.read().decode()
    assert list(_losses(tmp_path / "run")) == [1] and not (tmp_path / "run" / "head-final").exists()
    p = _cli(["train", str(two), "--no-progress", *ranks, "--resume"])
    assert p.wait(timeout=600) == 0, p.stderr.read().decode()[-2000:]
    assert list(_losses(tmp_path / "run")) == [1, 2, 3] and (tmp_path / "run" / "head-final").is_dir()


def test_a_time_boxed_stop_on_a_checkpoint_and_validation_step_keeps_the_validated_best(tmp_path, chat_model_dir):
    """A time box that ends on a step that both checkpoints and validates: the periodic checkpoint is
    written before that validation, so the stop must checkpoint again, or --resume starts from a best tau
    that misses the last validation (and a worse head could later replace head-best)."""
    train = {"max_steps": 4, "ckpt_every_steps": 2, "val_every_steps": 2, "val_prompts": 1}
    path = _recipe(tmp_path, chat_model_dir, train=train)
    out = tmp_path / "run"
    assert main(["train", str(path), "--no-progress", "--minutes", "1e-9"]) == 0  # step 1
    assert main(["train", str(path), "--no-progress", "--resume", "--minutes", "1e-9"]) == 0  # step 2: ckpt + val
    tau = json.loads((out / "metrics.json").read_text())["tau"]
    assert tau is not None and json.loads((out / "metrics.json").read_text())["step"] == 2
    state = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 2
    assert [s["best_tau"] for k, s in state["callbacks"].items() if "Outputs" in k] == [tau]


def test_a_time_box_that_ends_on_the_last_step_finishes_the_run(tmp_path, chat_model_dir, capsys):
    """Past the box on the run's last step there is nothing left to resume: the run ends as usual (final
    validation, head-final), not with a stop that a --resume would have to finish."""
    path = _recipe(tmp_path, chat_model_dir, train={"max_steps": 1, "val_every_steps": 0, "val_prompts": 1})
    assert main(["train", str(path), "--no-progress", "--minutes", "1e-9"]) == 0
    assert "(--minutes)" not in capsys.readouterr().err
    assert (tmp_path / "run" / "head-final").is_dir()
    assert [int(r["step"]) for r in _curve(tmp_path / "run") if r["kind"] == "val"] == [1]
