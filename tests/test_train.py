"""`headstart train` end to end on a tiny random target (the pieces are in test_train_parts.py, --resume
in test_train_resume.py): outputs, engine validation == the engine on the saved head, shards == online,
2 gloo processes == 1, every head family, non-finite steps, bad input, W&B offline. The run helpers here
(_recipe, _cli, _torchrun, _losses, _curve, _same_heads) are imported by test_train_resume.py too."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_conversations, write_jsonl

from headstart.cli import main
from headstart.errors import ConfigError, DataError
from headstart.heads import load_head
from headstart.models.llama import load_llama
from headstart.recipe_io import load_recipe
from headstart.train.validate import engine_acceptance

ROOT = Path(__file__).resolve().parents[1]


def _conversations(n, seed=0):
    return random_conversations(n, seed, max_rounds=2, user_words=(2, 10), reply_words=(4, 24))


def _recipe(tmp_path, model_dir, name="run", n=48, head="mtp", train=None, extra=""):
    data = tmp_path / f"{name}.jsonl"
    if not data.exists():
        write_jsonl(data, _conversations(n))
    tr = {"source": "online", "max_steps": 6, "batch_tokens": 256, "warmup_steps": 1, "val_every_steps": 3,
          "val_prompts": 3, "val_max_tokens": 8, "val_loss_batches": 2, "ckpt_every_steps": 2, **(train or {})}
    tr_lines = "".join(f"  {k}: {v}\n" for k, v in tr.items())
    text = (f"output_dir: {tmp_path / name}\nseed: 3\ntarget:\n  model: {model_dir}\n  dtype: fp32\n"
            f"data:\n  source: {data}\n  max_length: 96\n  heldout_fraction: 0.15\n"
            f"head:\n  type: {head}\n  k: 3\n{extra}"
            f"precompute:\n  shard_tokens: 400\n  batch_tokens: 256\n"
            f"train:\n{tr_lines}trainer:\n  precision: 32-true\nlogging:\n  wandb: false\n  every_steps: 1\n")
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


def test_the_online_source_reads_arrow_rows_as_the_lists_held_them(tmp_path, chat_model_dir):
    """The online source reads micro-batches from the dataset's Arrow table (memory-mapped, shared by the
    ranks), not from Python lists of every token: the same ids, masks and lengths, in any order."""
    from headstart.data.dataset import build_dataset
    from headstart.recipe_io import load_recipe
    from headstart.train.data import ArrowSequences, TokenSequences

    recipe = load_recipe(_recipe(tmp_path, chat_model_dir))
    train = build_dataset(recipe.data, str(chat_model_dir), progress=False).train
    arrow, lists = ArrowSequences(train), TokenSequences.from_dataset(train)
    assert arrow.lengths == lists.lengths and len(arrow.lengths) > 10
    for order in ([0], [5, 2, 9], list(range(len(arrow.lengths)))[::-1]):
        a, b = arrow.load(order), lists.load(order)
        assert a.seq_lens == b.seq_lens and torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.loss_mask, b.loss_mask) and a.input_ids.dtype == torch.long


def test_fp8_shards_reach_the_step_as_stored_and_train_as_dequantised(tmp_path, chat_model_dir):
    """With precompute.storage fp8 the training stream hands the step the stored e4m3 states and their
    scales (half the bytes through the copy to the GPU); the step dequantises them where it runs: the
    same loss as from states dequantised on the host."""
    from headstart.cli import main
    from headstart.heads import build_head, head_config_from_recipe
    from headstart.recipe_io import load_recipe
    from headstart.train.data import ShardSequences
    from headstart.train.module import HeadModule

    path = _recipe(tmp_path, chat_model_dir, head="eagle3", train={"source": "shards", "ttt_steps": 2},
                   extra="  aux_layer_ids: [0, 1, 2]\n")
    assert main(["precompute", str(path), "--set", "precompute.storage=fp8"]) == 0
    recipe = load_recipe(path)
    target = load_llama(chat_model_dir, "fp32")
    raw = ShardSequences(tmp_path / "run" / "precompute", keep_fp8=True).load([0, 1, 2])
    whole = ShardSequences(tmp_path / "run" / "precompute").load([0, 1, 2])
    assert raw.hidden.dtype == raw.aux_hidden.dtype == torch.float8_e4m3fn and raw.aux_scale.shape[1] == 3
    assert whole.hidden_scale is None and whole.hidden.dtype == torch.float32
    module = HeadModule(recipe, target, build_head(head_config_from_recipe(recipe.head), target))
    with torch.no_grad():
        torch.testing.assert_close(module.losses(raw)[0], module.losses(whole)[0], rtol=0, atol=0)


def _curve(run_dir):
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f)]


def _losses(run_dir):
    return {int(r["step"]): float(r["loss"]) for r in _curve(run_dir) if r["kind"] == "train"}


# ----------------------------------------------------------------------------------- end to end


def test_train_writes_heads_metrics_and_validates_with_the_engine(tmp_path, chat_model_dir, capsys):
    path = _recipe(tmp_path, chat_model_dir, train={"ttt_steps": 2})
    assert main(["train", str(path), "--no-progress"]) == 0
    printed = capsys.readouterr().out  # where the head serves, said before training (test_plan.py checks the lines)
    assert "train: the head serves on vLLM: " in printed and "train: the head serves on SGLang: " in printed
    assert printed.index("serves on") < printed.index("train: {")
    out = tmp_path / "run"
    for name in ("head-final", "head-best", "checkpoints/last.ckpt", "metrics.json", "metrics.csv", "train.json"):
        assert (out / name).exists(), name
    m = json.loads((out / "metrics.json").read_text())
    assert m["step"] == 6 and m["tokens"] > 0 and len(m["top1_per_step"]) == 2
    hist = m["accept_histogram"]
    assert len(hist) == 4 and sum(hist) == m["steps"] and len(m["accept_rate_per_pos"]) == 3 and m["val_loss"] > 0
    assert m["tau"] == pytest.approx(1 + sum(a * c for a, c in enumerate(hist)) / m["steps"])
    curve = _curve(out)
    assert [int(r["step"]) for r in curve if r["kind"] == "val"] == [3, 6]
    assert [int(r["step"]) for r in curve if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    # The callback measured the engine itself: the saved final head on the same prompts gives the same tau.
    recipe = load_recipe(path)
    from headstart.data.dataset import build_dataset
    from headstart.train.validate import heldout_prompts

    built = build_dataset(recipe.data, str(chat_model_dir), progress=False)
    prompts = heldout_prompts([list(x) for x in built.heldout["input_ids"]],
                              [list(x) for x in built.heldout["loss_mask"]], 3)
    tgt = load_llama(chat_model_dir, "fp32")
    head = load_head(out / "head-final", tgt)
    again = engine_acceptance(tgt, head, prompts, k=3, max_tokens=8, tokenizer=built.tokenizer, seed=3)
    assert again["tau"] == pytest.approx(m["tau"]) and again["steps"] == m["steps"]
    # A second run into the same directory is refused; head-final is a recognised head (not user data).
    capsys.readouterr()
    assert main(["train", str(path), "--no-progress"]) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_validation_runs_as_eval_does_outside_the_training_autocast(tmp_path, chat_model_dir, monkeypatch, capsys):
    """bf16-mixed training: the held-out losses run under the step's autocast, the engine outside it
    (under autocast every Linear would fall back to torch's matmul and skip the row-invariant
    kernels), so the callback's tau is what `headstart eval` reports for the saved head."""
    from headstart.train import run as train_run

    seen = []
    real = train_run.engine_acceptance

    def spy(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real(*args, **kwargs)

    monkeypatch.setattr(train_run, "engine_acceptance", spy)
    path = _recipe(tmp_path, chat_model_dir, train={"max_steps": 4, "val_every_steps": 4, "lr": 0.01})
    path.write_text(path.read_text().replace("dtype: fp32", "dtype: bf16").replace("32-true", "bf16-mixed"))
    assert main(["train", str(path), "--no-progress"]) == 0
    assert seen == [False]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    report = tmp_path / "eval"
    assert main(["eval", str(path), "--head", str(tmp_path / "run" / "head-final"), "--heldout", "3", "--k", "3",
                 "--max-tokens", "8", "--batch-size", "3", "--no-baseline", "--out", str(report)]) == 0
    run = json.loads((report / "report.json").read_text())["runs"][0]
    assert run["tau"] == pytest.approx(m["tau"]) and run["steps"] == m["steps"]


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_shards_and_online_give_the_same_first_losses(tmp_path, chat_model_dir, kind):
    """dflash: the shards hold its aux layers, and both sources draw the same anchors."""
    extra = "  block_size: 4\n  max_anchors: 24\n" if kind == "dflash" else ""
    online = _recipe(tmp_path, chat_model_dir, name="online", head=kind, extra=extra,
                     train={"max_steps": 3, "val_every_steps": 0})
    shards = _recipe(tmp_path, chat_model_dir, name="shards", head=kind, extra=extra,
                     train={"max_steps": 3, "val_every_steps": 0, "source": "shards"})
    assert main(["precompute", str(shards)]) == 0
    assert main(["train", str(online), "--no-progress"]) == 0
    assert main(["train", str(shards), "--no-progress"]) == 0
    a, b = _losses(tmp_path / "online"), _losses(tmp_path / "shards")
    assert list(a) == [1, 2, 3]
    for step in a:  # shards hold bf16 hidden states, the online forward fp32
        assert b[step] == pytest.approx(a[step], rel=2e-2)


def test_shards_from_another_target_are_refused(tmp_path, chat_model_dir):
    from tiny_models import make_hf_model

    from headstart.train import run_train

    shards = _recipe(tmp_path, chat_model_dir, name="s", train={"source": "shards"})
    assert main(["precompute", str(shards)]) == 0
    other = tmp_path / "other-model"
    make_hf_model("llama", other, seed=99, vocab_size=len(__import__("conftest").make_tokenizer("chatml")))
    __import__("conftest").make_tokenizer("chatml").save_pretrained(other)
    recipe = load_recipe(shards, [f"target.model={other}", f"output_dir={tmp_path / 'o'}",
                                  f"train.shards_dir={tmp_path / 's' / 'precompute'}"])
    with pytest.raises(DataError, match="shards were computed with target"):
        run_train(recipe, progress=False)


def _cli(args, env=None):
    return subprocess.Popen([sys.executable, "-m", "headstart.cli", *args], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_two_gloo_processes_equal_one_with_accumulation(tmp_path, chat_model_dir):
    train = {"max_steps": 3, "val_every_steps": 0, "val_prompts": 1}
    one = _recipe(tmp_path, chat_model_dir, name="one", train={**train, "grad_accum": 2}, n=64)
    p = _cli(["train", str(one), "--no-progress"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    two = _recipe(tmp_path, chat_model_dir, name="two", train=train, n=64)
    p = _cli(["train", str(two), "--no-progress", "--set", "trainer.devices=2", "--set", "trainer.accelerator=cpu"])
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err.decode()[-3000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert list(a) == list(b) == [1, 2, 3]
    # Logged losses are one micro-batch's (rank 0's / the last accumulated): compare the updated heads.
    ha = load_head(tmp_path / "one" / "head-final", load_llama(chat_model_dir, "fp32"))
    hb = load_head(tmp_path / "two" / "head-final", load_llama(chat_model_dir, "fp32"))
    for (name, x), (_, y) in zip(ha.state_dict().items(), hb.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm", "dflash"])
def test_every_head_family_trains(tmp_path, chat_model_dir, kind):
    extra = "  draft_vocab_size: 96\n" if kind in ("eagle3", "medusa", "dflash") else ""
    if kind == "dflash":
        extra += "  block_size: 4\n"
    path = _recipe(tmp_path, chat_model_dir, head=kind, extra=extra,
                   train={"max_steps": 2, "val_every_steps": 0, "val_prompts": 2, "ttt_steps": 2})
    assert main(["train", str(path), "--no-progress"]) == 0
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["tau"] is not None and m["val_loss"] > 0
    head = load_head(tmp_path / "run" / "head-final", load_llama(chat_model_dir, "fp32"))
    if kind in ("eagle3", "medusa", "dflash"):
        assert head.d2t.numel() == 96 and int(head.d2t.max()) > 0  # the reduced vocabulary was installed


def test_max_sequences_trains_on_the_first_conversations_only(tmp_path, chat_model_dir, capsys):
    """train.max_sequences=N (a data-size ablation): one epoch is exactly the first N training sequences' tokens,
    the draft vocabulary is counted from them alone, and a size above the split is refused by name."""
    from headstart.data.dataset import build_dataset
    from headstart.heads import build_vocab_maps
    from headstart.train.data import ArrowSequences, supervised_token_counts

    extra = "  aux_layer_ids: [0, 1, 2]\n  draft_vocab_size: 40\n"
    path = _recipe(tmp_path, chat_model_dir, head="eagle3", extra=extra,
                   train={"max_sequences": 7, "epochs": 1, "max_steps": 500, "val_every_steps": 0})
    assert main(["train", str(path), "--no-progress"]) == 0
    train = build_dataset(load_recipe(path).data, str(chat_model_dir), progress=False).train
    lengths = ArrowSequences(train).lengths
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert len(lengths) > 20 and m["tokens"] == sum(n for n in lengths[:7] if n >= 3)
    vocab = (target := load_llama(chat_model_dir, "fp32")).config.vocab_size
    counts = supervised_token_counts(ArrowSequences(train), vocab, 7)
    first = torch.cat([torch.tensor(ids)[torch.tensor(mask).bool()] for ids, mask in
                       zip(train["input_ids"][:7], train["loss_mask"][:7])])
    assert torch.equal(counts, torch.bincount(first, minlength=vocab).double())
    head = load_head(tmp_path / "run" / "head-final", target)
    assert torch.equal(head.t2d, build_vocab_maps(counts, 40)[1])  # the vocabulary of the sequences trained on
    assert not torch.equal(head.t2d, build_vocab_maps(supervised_token_counts(ArrowSequences(train), vocab), 40)[1])
    capsys.readouterr()
    over = len(lengths) + 1
    assert main(["train", str(path), "--no-progress", "--set", f"train.max_sequences={over}", "--set",
                 f"output_dir={tmp_path / 'over'}"]) == 2
    assert f"train.max_sequences={over} but the training split holds {len(lengths)}" in capsys.readouterr().err
    # Shards of the whole data (split all): their first N are not the training split's first N.
    assert main(["precompute", str(path), "--set", "precompute.split=all"]) == 0
    capsys.readouterr()
    shards = tmp_path / "run" / "precompute"
    assert main(["train", str(path), "--no-progress", "--set", "train.source=shards", "--set",
                 f"output_dir={tmp_path / 'all'}", "--set", f"train.shards_dir={shards}"]) == 2
    assert "shards hold" in capsys.readouterr().err


def test_bad_input_is_one_clear_line(tmp_path, chat_model_dir, capsys):
    small = _recipe(tmp_path, chat_model_dir, name="small", train={"batch_tokens": 16})
    assert main(["train", str(small), "--no-progress"]) == 2
    assert "train.batch_tokens=16 is smaller than the longest" in capsys.readouterr().err
    empty = _recipe(tmp_path, chat_model_dir, name="empty", n=1)
    assert main(["train", str(empty), "--no-progress", "--set", "data.heldout_fraction=0.99"]) == 2
    err = capsys.readouterr().err
    assert "training split is empty" in err and "Traceback" not in err
    noshards = _recipe(tmp_path, chat_model_dir, name="noshards", train={"source": "shards"})
    assert main(["train", str(noshards), "--no-progress"]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    many = _recipe(tmp_path, chat_model_dir, name="many", train={"val_prompts": 500, "max_steps": 1})
    assert main(["train", str(many), "--no-progress"]) == 0
    assert "validating on" in capsys.readouterr().err


def test_non_finite_losses_skip_steps_then_stop(tmp_path, chat_model_dir, capsys):
    path = _recipe(tmp_path, chat_model_dir, train={"lr": "1.0e+30", "max_bad_steps": 2, "grad_clip": 0.0,
                                                    "val_every_steps": 0})
    assert main(["train", str(path), "--no-progress"]) == 2
    out = capsys.readouterr()
    assert "non-finite loss" in out.err and "consecutive steps" in out.err


def test_auto_precision_follows_the_hardware(monkeypatch):
    from headstart import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert hardware.resolve_dtype("auto") == "fp32" and hardware.resolve_precision("auto", "cpu") == "32-true"
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert hardware.resolve_dtype("auto") == "bf16" and hardware.resolve_precision("auto", "cpu") == "bf16-mixed"
    assert hardware.resolve_dtype("fp16") == "fp16"


def test_precision_and_dtype_must_agree(tmp_path, chat_model_dir):
    from headstart.train import run_train

    recipe = load_recipe(_recipe(tmp_path, chat_model_dir), ["target.dtype=bf16"])
    with pytest.raises(ConfigError, match="trainer.precision 32-true"):
        run_train(recipe, progress=False)


def test_heldout_prompts_are_the_first_user_turn_with_the_generation_prompt(chat_model_dir):
    from headstart.config import DataConfig
    from headstart.data.dataset import build_dataset, load_tokenizer
    from headstart.train.validate import heldout_prompts

    rows = [{"id": "a", "conversations": [{"from": "human", "value": "hello heads"},
                                          {"from": "gpt", "value": "draft tokens fast"},
                                          {"from": "human", "value": "more"}, {"from": "gpt", "value": "the a"}]}]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = write_jsonl(Path(d) / "one.jsonl", rows)
        built = build_dataset(DataConfig(source=str(src), max_length=96, heldout_fraction=0.0), str(chat_model_dir),
                              progress=False)
    (prompt,) = heldout_prompts([list(x) for x in built.train["input_ids"]],
                                [list(x) for x in built.train["loss_mask"]], 5)
    tok = load_tokenizer(chat_model_dir)
    expected = tok.apply_chat_template([{"role": "user", "content": "hello heads"}], tokenize=True,
                                       add_generation_prompt=True)
    assert prompt == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_more_bad_input_is_refused_before_any_work(tmp_path, chat_model_dir, capsys):
    path = _recipe(tmp_path, chat_model_dir, train={"max_steps": 2, "val_every_steps": 0, "val_prompts": 1})
    out = tmp_path / "run"

    def fails(*args, match):
        assert main(["train", str(path), "--no-progress", *args]) == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, err

    if not torch.cuda.is_available():
        fails("--set", "trainer.accelerator=gpu", match="no CUDA GPU is visible")
    fails("--set", "head.type=eagle3", "--set", "train.loss_weights.kl=0", match="learns from the KL term only")
    out.mkdir(exist_ok=True)
    (out / "metrics.csv").write_text("my own numbers\n")
    fails(match="that no training run of headstart wrote")
    assert (out / "metrics.csv").read_text() == "my own numbers\n"
    (out / "metrics.csv").unlink()
    (out / "head-final").mkdir()
    (out / "head-final" / "notes.txt").write_text("mine")
    fails(match="head-final that no training run")
    record = json.dumps({"format": "headstart-train/1"})
    (out / "train.json").write_text(record)  # even inside a run's directory, a user's head-final stays
    fails(match="exists and is not empty")
    (out / "train.json").unlink()
    assert (out / "head-final" / "notes.txt").read_text() == "mine"
    (out / "head-final" / "notes.txt").unlink()
    (out / "head-final").rmdir()
    fails("--resume", match="holds no checkpoint to resume")
    (out / "train.json").write_text(record)  # a run that died before its first checkpoint starts afresh
    assert main(["train", str(path), "--no-progress"]) == 0
    ckpt = out / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    fails("--resume", "--set", "train.max_steps=3", match="damaged")


def test_weights_and_biases_logs_offline_without_an_api_key(tmp_path, chat_model_dir, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    path = _recipe(tmp_path, chat_model_dir, train={"max_steps": 2, "val_every_steps": 0, "val_prompts": 1})
    assert main(["train", str(path), "--no-progress", "--set", "logging.wandb=true"]) == 0
    assert "logs offline" in capsys.readouterr().err
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_two_nodes_of_one_rank_each_equal_one_process(tmp_path, chat_model_dir):
    """A 2-node x 1-rank gloo job on this machine: two torchrun agents (node ranks 0 and 1) that meet
    at one rendezvous address, as two hosts of a cluster would. The trained head equals one process
    accumulating the same two micro-batches."""
    import socket

    train = {"max_steps": 3, "val_every_steps": 0, "val_prompts": 1}
    one = _recipe(tmp_path, chat_model_dir, name="one", train={**train, "grad_accum": 2}, n=64)
    p = _cli(["train", str(one), "--no-progress"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    nodes = _recipe(tmp_path, chat_model_dir, name="nodes", train=train, n=64)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={r}",
         "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "headstart.cli", "train", str(nodes),
         "--no-progress", "--set", "trainer.num_nodes=2", "--set", "trainer.accelerator=cpu"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for r in (0, 1)]
    errs = [a.communicate(timeout=600)[1].decode() for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(e[-2000:] for e in errs)
    assert "head-final" in {p.name for p in (tmp_path / "nodes").iterdir()}
    ha = load_head(tmp_path / "one" / "head-final", load_llama(chat_model_dir, "fp32"))
    hb = load_head(tmp_path / "nodes" / "head-final", load_llama(chat_model_dir, "fp32"))
    for (name, x), (_, y) in zip(ha.state_dict().items(), hb.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=name)


def _torchrun(nproc, args):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
         "headstart.cli", *args], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_online_training_with_a_tensor_parallel_target_equals_one_process(tmp_path, chat_model_dir):
    """engine.tensor_parallel 2 in train: both ranks hold half of the target and run each other's
    micro-batch forwards in turn, the head (copied from the target's layers, draft vocabulary) is
    data-parallel over the two, and engine validation runs on the sharded target. The head, the
    held-out loss and the engine's acceptance equal one process accumulating the two micro-batches."""
    # A validation at step 2 (under TP, on the sharded target) and a training step after it: the head
    # must read its own whole embedding / lm_head again.
    train = {"max_steps": 3, "val_every_steps": 2, "val_prompts": 2}
    extra = "  draft_vocab_size: 96\n  init_from_target: true\n"
    one = _recipe(tmp_path, chat_model_dir, name="one", train={**train, "grad_accum": 2}, n=64, extra=extra)
    p = _cli(["train", str(one), "--no-progress"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    tp = _recipe(tmp_path, chat_model_dir, name="tp", train=train, n=64, extra=extra)
    p = _torchrun(2, ["train", str(tp), "--no-progress", "--set", "trainer.devices=2", "--set",
                      "trainer.accelerator=cpu", "--tp", "2"])
    _, err = p.communicate(timeout=900)
    assert p.returncode == 0, err.decode()[-3000:]
    ha = load_head(tmp_path / "one" / "head-final", load_llama(chat_model_dir, "fp32"))
    hb = load_head(tmp_path / "tp" / "head-final", load_llama(chat_model_dir, "fp32"))
    for (name, x), (_, y) in zip(ha.state_dict().items(), hb.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=name)
    ma, mb = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("one", "tp"))
    assert mb["val_loss"] == pytest.approx(ma["val_loss"], rel=1e-4)
    assert mb["tau"] == ma["tau"] and mb["accept_histogram"] == ma["accept_histogram"]
    record = json.loads((tmp_path / "tp" / "train.json").read_text())
    assert record["recipe"]["engine.tensor_parallel"] == 2


def test_a_tensor_parallel_train_needs_its_ranks_launched(tmp_path, chat_model_dir, capsys, monkeypatch):
    path = _recipe(tmp_path, chat_model_dir, train={"max_steps": 2})
    assert main(["train", str(path), "--no-progress", "--tp", "2", "--set", "trainer.devices=2"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nnodes 1 --nproc-per-node 2" in err and "no WORLD_SIZE" in err and "Traceback" not in err
    assert main(["train", str(path), "--no-progress", "--tp", "2"]) == 2  # 1 device: tp 2 cannot divide it
    assert "set trainer.devices to a multiple of 2" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun sets it (a WORLD_SIZE no launcher set is refused)
    assert main(["train", str(path), "--no-progress", "--tp", "2", "--set", "trainer.devices=2"]) == 2
    assert "WORLD_SIZE=4 ranks but trainer.devices x trainer.num_nodes = 2 x 1 = 2" in capsys.readouterr().err


def _same_heads(a, b, model_dir):
    ha = load_head(a / "head-final", load_llama(model_dir, "fp32"))
    hb = load_head(b / "head-final", load_llama(model_dir, "fp32"))
    for (name, x), (_, y) in zip(ha.state_dict().items(), hb.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_from_shards_equal_one_process(tmp_path, chat_model_dir, strategy):
    """From shards only rank 0 (which validates) loads the whole target; rank 1 holds the embedding, norm and
    lm_head, its head starts from rank 0's. The trained eagle3 head (own draft lm_head: FusedChunks under both
    strategies) equals one process accumulating the two micro-batches."""
    train = {"max_steps": 3, "val_every_steps": 3, "val_prompts": 2, "source": "shards"}
    extra = "  init_from_target: true\n  aux_layer_ids: [0, 1, 2]\n  draft_vocab_size: 96\n"
    one = _recipe(tmp_path, chat_model_dir, "one", 64, "eagle3", train={**train, "grad_accum": 2}, extra=extra)
    assert main(["precompute", str(one)]) == 0
    p = _cli(["train", str(one), "--no-progress"])
    assert p.wait() == 0, p.stderr.read().decode()[-2000:]
    two = _recipe(tmp_path, chat_model_dir, "two", 64, "eagle3", {**train, "shards_dir": tmp_path / "one/precompute"},
                  extra=extra)
    launch = _cli if strategy == "ddp" else lambda args: _torchrun(2, args)  # Lightning spawns DDP ranks itself
    p = launch(["train", str(two), "--no-progress", "--set", "trainer.devices=2", "--set", "trainer.accelerator=cpu",
                "--set", f"trainer.strategy={strategy}"])
    _, err = p.communicate(timeout=900)
    assert p.returncode == 0, err.decode()[-3000:]
    _same_heads(tmp_path / "one", tmp_path / "two", chat_model_dir)


def test_the_head_starts_from_the_recipe_seed(tmp_path, chat_model_dir):
    """eagle3 keeps random q/k/v after its init from the target: two builds of one recipe start from the
    same head (so a rerun, a resume and every rank agree), another seed from another."""
    from headstart.train.run import TrainRun

    def head(name, seed):
        path = _recipe(tmp_path, chat_model_dir, name=name, head="eagle3", train={"max_steps": 1})
        recipe = load_recipe(path, [f"seed={seed}"])
        return TrainRun(recipe, progress=False).head.state_dict()

    a, b, c = head("a", 3), head("b", 3), head("c", 4)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(a["layers.0.self_attn.qkv_proj.weight"], c["layers.0.self_attn.qkv_proj.weight"])
