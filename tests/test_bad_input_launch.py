"""Bad launches (issue 34): a resume from another head's checkpoint, multi-process launches without
torchrun, a rendezvous whose ranks never come, SIGTERM. Each ends with one clear line, never a
traceback or a hang."""

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import fails_with_one_line, random_conversations, write_jsonl

from headstart.cli import main

ROOT = Path(__file__).resolve().parents[1]


_fails = fails_with_one_line


def _recipe(tmp_path, model_dir, name, head, steps=2):
    data = tmp_path / "d.jsonl"
    if not data.exists():
        write_jsonl(data, random_conversations(24, 0, max_rounds=1, user_words=(2, 8), reply_words=(4, 16)))
    text = (f"output_dir: {tmp_path / name}\nseed: 3\ntarget:\n  model: {model_dir}\n  dtype: fp32\n"
            f"data:\n  source: {data}\n  max_length: 64\n  heldout_fraction: 0.15\nhead:\n  type: {head}\n  k: 2\n"
            f"train:\n  source: online\n  max_steps: {steps}\n  batch_tokens: 128\n  warmup_steps: 1\n"
            "  val_every_steps: 0\n  val_prompts: 1\n  val_max_tokens: 4\n  val_loss_batches: 1\n"
            "  ckpt_every_steps: 1\ntrainer:\n  precision: 32-true\nlogging:\n  wandb: false\n")
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


def test_resume_from_another_heads_checkpoint_names_both_types(tmp_path, chat_model_dir, capsys):
    mtp, dflash = (_recipe(tmp_path, chat_model_dir, n, n) for n in ("mtp", "dflash"))
    assert main(["train", str(mtp), "--no-progress"]) == 0
    assert main(["train", str(dflash), "--no-progress"]) == 0
    capsys.readouterr()
    shutil.copy(tmp_path / "dflash" / "checkpoints" / "last.ckpt", tmp_path / "mtp" / "checkpoints" / "last.ckpt")
    err = _fails(capsys, ["train", str(mtp), "--no-progress", "--resume", "--set", "train.max_steps=3"], "dflash")
    assert "mtp" in err and "last.ckpt" in err
    assert json.loads((tmp_path / "mtp" / "train.json").read_text())["format"] == "headstart-train/1"
    import torch  # a checkpoint of an older headstart records no head type: its tensors tell

    ckpt = torch.load(tmp_path / "mtp" / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt["headstart"].pop("head_type")
    torch.save(ckpt, tmp_path / "mtp" / "checkpoints" / "last.ckpt")
    _fails(capsys, ["train", str(mtp), "--no-progress", "--resume", "--set", "train.max_steps=3"],
           "not the recipe's mtp head (missing ['head.")


QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")


def test_fsdp_on_several_ranks_without_torchrun_is_refused_with_the_torchrun_line(capsys, monkeypatch, tmp_path):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "never"
    err = _fails(capsys, ["train", QUICKSTART, "--set", "trainer.strategy=fsdp", "--set", "trainer.devices=2",
                          "--set", f"output_dir={out}"], "torchrun --nproc-per-node 2 -m headstart.cli train")
    assert f"{QUICKSTART} --set trainer.strategy=fsdp --set trainer.devices=2" in err
    _fails(capsys, ["train", QUICKSTART, "--set", "trainer.num_nodes=2", "--set", f"output_dir={out}"],
           "torchrun --nnodes 2")
    assert not out.exists()


def test_a_world_size_no_launcher_set_is_refused(capsys, monkeypatch, tmp_path):
    for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "never"
    _fails(capsys, ["train", QUICKSTART, "--set", f"output_dir={out}"], "WORLD_SIZE=2 is set in the environment")
    _fails(capsys, ["eval", QUICKSTART, "--head", str(tmp_path)], "unset WORLD_SIZE")
    _fails(capsys, ["precompute", QUICKSTART, "--set", f"output_dir={out}"], "unset WORLD_SIZE")
    assert not out.exists()


def _cli(argv, env, **kw):
    import os
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "headstart.cli", *argv], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env}, **kw)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eval_argv(tmp_path, chat_model_dir, tp):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    head = tmp_path / "h"
    if not head.exists():
        assert main(["head", "init", "--type", "mtp", "--model", str(chat_model_dir), "--out", str(head)]) == 0
    r = tmp_path / "r.yaml"
    r.write_text(f"output_dir: {tmp_path / 'run'}\ntarget:\n  model: {chat_model_dir}\n  dtype: fp32\n")
    return ["eval", str(r), "--tp", str(tp), "--head", str(head), "--prompts", str(prompts), "--k", "1",
            "--max-tokens", "2", "--no-progress"]


def test_a_rendezvous_names_the_ranks_that_never_came(tmp_path, chat_model_dir):
    env = {"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "HEADSTART_RENDEZVOUS_TIMEOUT_S": "3"}
    p = _cli(_eval_argv(tmp_path, chat_model_dir, 3), env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert "1 of WORLD_SIZE=3 ranks came" in last and "rank(s) 1, 2 never came" in last, err
    # A rank whose rank 0 never starts: named too.
    env = {**env, "RANK": "2", "MASTER_PORT": str(_free_port())}
    p = _cli(_eval_argv(tmp_path, chat_model_dir, 3), env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "found no rank 0" in err.strip().splitlines()[-1], err


def test_sigterm_ends_a_verb_even_when_it_is_blocked(tmp_path, chat_model_dir):
    """A rank waiting for its rank 0 is blocked inside torch's store (no Python runs): SIGTERM still
    ends it, after the grace period; one waiting in Python ends at once."""
    import signal
    import subprocess
    import threading
    import time

    argv = _eval_argv(tmp_path, chat_model_dir, 2)
    for rank, said, code in (("1", "still running 1s after SIGTERM", -signal.SIGKILL),
                             ("0", "headstart: terminated (SIGTERM)", 128 + signal.SIGTERM)):
        env = {"WORLD_SIZE": "2", "RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "HEADSTART_RENDEZVOUS_TIMEOUT_S": "600", "HEADSTART_TERM_GRACE_S": "1"}
        p = _cli(argv, env, stdin=subprocess.DEVNULL)
        lines: list[str] = []

        def read(stream=p.stderr, into=lines):
            for line in stream:
                into.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("rendezvous: rank" in x for x in lines):
            time.sleep(0.2)  # until it waits at the rendezvous (rank 0 says so after 10 s)
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(f"rank {rank} ignored SIGTERM: {''.join(lines)}") from None
        reader.join(timeout=10)
        err = "".join(lines)
        assert p.returncode == code and said in err, (rank, p.returncode, err)


def test_a_finished_rank_is_not_aborted_in_the_interpreters_teardown(tmp_path):
    """gloo's worker thread frees the last collective's tensors, which needs the GIL; if it gets it only
    once the interpreter's teardown has begun, Python ends that thread inside a C++ destructor and the
    finished rank aborts (SIGABRT), so torchrun reports the run failed (stop 36's CI run, 1 in ~30 2-rank
    runs). tests/exit_worker.py makes that timing certain. end_rank skips the teardown."""
    import os
    import signal
    import subprocess
    import sys

    # From Python 3.14 a thread that takes the GIL in the teardown waits forever instead (gh-87135).
    aborts = sys.version_info < (3, 14)
    for how, code in (("return", -signal.SIGABRT if aborts else 0), ("end_rank", 0)):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
        ranks = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "exit_worker.py"), how], text=True,
                                  env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for r in (0, 1)]
        (_, err0), (_, err1) = (p.communicate(timeout=120) for p in ranks)
        assert ranks[1].returncode == 0, err1
        assert ranks[0].returncode == code, (how, ranks[0].returncode, err0)
        assert ("terminate called without an active exception" in err0) == (how == "return" and aborts), err0


def test_the_command_line_ends_a_rank_without_the_teardown(tmp_path):
    """`headstart VERB` as one rank of several ends through end_rank however the verb ends (a code, a
    sys.exit as Lightning's after SIGTERM, an unexpected error): its exit handlers run, its code is kept,
    nothing is finalised in a teardown; run alone, it ends as any Python program."""
    import os
    import subprocess
    import sys

    missing = ["eval", str(tmp_path / "missing.yaml"), "--head", "h", "--prompts", "p"]
    verbs = {"code": (None, 2, "missing.yaml"), "exit": ("sys.exit(3)", 3, ""),
             "error": ("raise RuntimeError('verb broke')", 1, "RuntimeError: verb broke")}
    for how, (body, code, said) in verbs.items():
        patch = f"def broken(argv):\n    {body}\ncli._main = broken\n" if body else ""
        script = ("import atexit, sys\nfrom headstart import cli\n"
                  "class Teardown:\n    def __del__(self):\n        print('teardown ran', flush=True)\n"
                  "kept = Teardown()\natexit.register(lambda: print('exit handlers ran'))\n"
                  f"{patch}sys.argv = ['headstart', *{missing!r}]\nsys.exit(cli.main())\n")
        for world, teardown in (("2", False), ("1", True)):
            # stdout is a pipe, block-buffered: what the exit handler prints is kept only if end_rank flushes it
            env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
            env = {**env, "PYTHONPATH": str(ROOT), "WORLD_SIZE": world, "RANK": str(int(world) - 1)}
            p = subprocess.run([sys.executable, "-c", script], env=env, text=True, capture_output=True,
                               timeout=120, stdin=subprocess.DEVNULL)
            assert p.returncode == code and said in p.stderr, (how, world, p.returncode, p.stderr)
            assert "exit handlers ran" in p.stdout, (how, world, p.stdout)
            assert ("teardown ran" in p.stdout) == teardown, (how, world, p.stdout)


def test_launched_ranks_reads_world_size_or_says_one(monkeypatch):
    from headstart.launch import launched_ranks

    for text, ranks in (("2", 2), (" 16 ", 16), ("1", 1), ("0", 0), ("abc", 1), ("-3", 1), ("\u00b2", 1), ("", 1)):
        monkeypatch.setenv("WORLD_SIZE", text)
        assert launched_ranks() == ranks, text
    monkeypatch.delenv("WORLD_SIZE")
    assert launched_ranks() == 1


def test_a_bad_wait_setting_is_one_line_for_every_verb_even_help(monkeypatch):
    """HEADSTART_TERM_GRACE_S is read before any verb (the signal handlers): a bad value is one line and
    exit 2, even for --version; an absurd HEADSTART_RENDEZVOUS_TIMEOUT_S is named, not an OverflowError."""
    import os
    import subprocess
    import sys

    from headstart.errors import ConfigError
    from headstart.launch import _seconds

    for value in ("abc", "-1", "nan", "", "1e300"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HEADSTART_TERM_GRACE_S": value}
        p = subprocess.run([sys.executable, "-m", "headstart.cli", "--version"], env=env, text=True,
                           capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (value, p.stderr)
        assert p.stderr.strip().splitlines() == [f"headstart: error: HEADSTART_TERM_GRACE_S={value!r}: expected a "
                                                 "positive number of seconds (at most 1e+08)"], p.stderr
    monkeypatch.setenv("HEADSTART_RENDEZVOUS_TIMEOUT_S", "1e300")
    with pytest.raises(ConfigError, match="HEADSTART_RENDEZVOUS_TIMEOUT_S='1e300'"):
        _seconds("HEADSTART_RENDEZVOUS_TIMEOUT_S", 300.0)


def test_a_closed_pipe_and_a_refused_write_end_in_one_line(tmp_path, capsys, monkeypatch):
    """`headstart plan RECIPE | head` ends quietly when the reader leaves; a write the file system refuses
    (permissions, read-only, full) names the path in one line, no traceback; other errors are not hidden."""
    import errno
    import subprocess
    import sys

    from headstart import cli

    script = ("import sys\nfrom headstart import cli, commands\n"  # a verb that prints more than a pipe holds
              "commands.cmd_plan = lambda args: [print('x' * 99) for _ in range(100_000)] and 0\n"
              "sys.argv = ['headstart', 'plan', 'r.yaml']\nsys.exit(cli.main())\n")
    (tmp_path / "verb.py").write_text(script)
    line = f"{sys.executable} {tmp_path / 'verb.py'} | head -1; echo \"rc=${{PIPESTATUS[0]}}\""
    p = subprocess.run(["bash", "-c", line], text=True, capture_output=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert p.stdout.splitlines() == ["x" * 99, "rc=141"], p.stdout[-300:]
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    for exc in (PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "out" / "config.json")),
                OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))):
        def refused(args, exc=exc):
            raise exc
        monkeypatch.setattr(cli.commands, "cmd_export", refused)
        assert cli.main(["export", "h", "--format", "vllm", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"headstart: error: {exc.filename}: {exc.strerror}"), err
    monkeypatch.setattr(cli.commands, "cmd_export", lambda args: (_ for _ in ()).throw(FileNotFoundError("bug")))
    with pytest.raises(FileNotFoundError):
        cli.main(["export", "h", "--format", "vllm", "--out", str(tmp_path / "out")])
    # a library call's broken pipe is the caller's: raised, its streams left as they are
    monkeypatch.setattr(cli.commands, "cmd_export", lambda args: (_ for _ in ()).throw(BrokenPipeError()))
    with pytest.raises(BrokenPipeError):
        cli.main(["export", "h", "--format", "vllm", "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("env, named", [
    ({"WORLD_SIZE": "-1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, "WORLD_SIZE='-1' in the environment"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' in the environment"),
    ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512"},
     "RANK=5 in the environment, but WORLD_SIZE=2"),
    ({"WORLD_SIZE": "1", "RANK": "3"}, "RANK=3 in the environment, but WORLD_SIZE=1"),
    ({"RANK": "1"}, "WORLD_SIZE=(unset: 1)"),
])
def test_a_launch_environment_that_cannot_be_is_named_before_any_wait(monkeypatch, env, named):
    """Every verb's launch checks (and the rendezvous, which would otherwise wait its whole timeout for a rank
    that cannot exist) name the variable; a sound one passes."""
    from headstart.errors import ConfigError
    from headstart.launch import check_world_size, launch_env, rendezvous

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for call in (launch_env, lambda: check_world_size("eval"), lambda: rendezvous(timeout_s=600)):
        with pytest.raises(ConfigError, match=re.escape(named)):
            call()
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert launch_env() == (2, 1)
    monkeypatch.setenv("LOCAL_RANK", "-1")  # "no local rank", as some launchers write it
    monkeypatch.setenv("WORLD_SIZE", " ")  # empty: unset, one process
    monkeypatch.setenv("RANK", "0")
    assert launch_env() == (1, 0)
