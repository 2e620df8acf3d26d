"""Bad launches (issue 34): a resume from another head's checkpoint, multi-process launches without
torchrun, a rendezvous whose ranks never come, SIGTERM. Each ends with one clear line, never a
traceback or a hang."""

import json
import shutil
from pathlib import Path

from conftest import random_conversations, write_jsonl

from headstart.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _fails(capsys, argv, match):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # progress bars may come before it
    assert last.startswith("headstart: error:") and match in last and "Traceback" not in err, err
    return last


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
