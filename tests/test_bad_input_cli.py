"""Bad input at the command line, continued (issue 34): no file of the user's is lost, nothing is
silently accepted, and a refusal is one `headstart: error:` line naming what, where and what to do."""

import json

import pytest

from headstart.cli import main


def _fails(capsys, argv, match):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # progress bars may come before it
    assert last.startswith("headstart: error:") and match in last and "Traceback" not in err, err
    return last


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
