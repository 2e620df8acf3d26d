"""Bad input and faults at the command line (issue: no data loss, no tracebacks, no memory bombs):
each case is one clear `headstart: error:` line and exit code 2."""

import json

import pytest

from headstart.cli import main


def _fails(capsys, argv, match):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # progress bars may come before it
    assert last.startswith("headstart: error:") and match in last and "Traceback" not in err, err
    return last


@pytest.fixture
def head_dir(chat_model_dir, tmp_path):
    out = tmp_path / "head"
    assert main(["head", "init", "--type", "mtp", "--model", str(chat_model_dir), "--out", str(out)]) == 0
    return out


def _gen(model, *extra):
    return ["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "4", "--dtype", "fp32", *extra]


def test_generate_arguments_are_checked(chat_model_dir, capsys):
    _fails(capsys, _gen(chat_model_dir, "--page-size", "0"), "page_size must be an integer >= 1")
    _fails(capsys, _gen(chat_model_dir, "--batch-size", "0"), "max_batch_size must be an integer >= 1")
    _fails(capsys, _gen(chat_model_dir, "--device", "tpu"), "use cpu or cuda")
    _fails(capsys, _gen(chat_model_dir, "--device", "meta"), "headstart runs on cpu or cuda")
    _fails(capsys, _gen(chat_model_dir, "--device", "nonsense!"), "not a device")
    import torch

    if not torch.cuda.is_available():
        _fails(capsys, _gen(chat_model_dir, "--device", "cuda"), "no CUDA GPU is visible")
    _fails(capsys, _gen(chat_model_dir, "--temperature", "nan"), "temperature must be a finite number")
    _fails(capsys, _gen(chat_model_dir, "--stop", ""), "stop strings must be non-empty")


def test_speculation_that_could_never_run_is_refused(chat_model_dir, head_dir, capsys):
    _fails(capsys, _gen(chat_model_dir, "--spec", "tree", "--head", str(head_dir), "--tree-tokens", "100000"),
           "it could never run")


def test_head_init_values(chat_model_dir, tmp_path, capsys):
    base = ["head", "init", "--model", str(chat_model_dir), "--out", str(tmp_path / "h")]
    _fails(capsys, base + ["--type", "mtp", "--num-layers", "0"], "num_layers must be >= 1")
    _fails(capsys, base + ["--type", "medusa", "--medusa-heads", "0"], "medusa_num_heads")


def test_damaged_heads_are_named(chat_model_dir, head_dir, capsys):
    cfg = head_dir / "config.json"
    good = cfg.read_text()
    for text, match in (("[1, 2]", "expected a JSON object"), ("{not json", "not valid JSON"),
                        (json.dumps({**json.loads(good), "num_layers": 10**9}), "num_layers=1000000000 is outside"),
                        (json.dumps({**json.loads(good), "intermediate_size": 10**12}), "intermediate_size")):
        cfg.write_text(text)
        err = _fails(capsys, _gen(chat_model_dir, "--spec", "chain", "--head", str(head_dir)), match)
        assert str(cfg) in err
    cfg.write_text(good)
    weights = head_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _fails(capsys, _gen(chat_model_dir, "--spec", "chain", "--head", str(head_dir)), "sha256 differs")
    weights.write_bytes(data[:-4] + bytes(4))  # same size, altered
    _fails(capsys, _gen(chat_model_dir, "--spec", "chain", "--head", str(head_dir)), "sha256 differs")
    weights.unlink()
    _fails(capsys, _gen(chat_model_dir, "--spec", "chain", "--head", str(head_dir)), "missing")


def test_a_head_of_another_target_needs_allow_other_target(chat_model_dir, tmp_path, capsys):
    from conftest import make_tokenizer
    from tiny_models import make_hf_model

    other = tmp_path / "other"
    tok = make_tokenizer("chatml")
    make_hf_model("llama", other, seed=77, vocab_size=len(tok))  # same shape, other weights
    tok.save_pretrained(other)
    head = tmp_path / "h"
    assert main(["head", "init", "--type", "mtp", "--model", str(other), "--out", str(head)]) == 0
    _fails(capsys, _gen(chat_model_dir, "--spec", "chain", "--head", str(head)), "--allow-other-target")
    with pytest.warns(UserWarning, match="acceptance may be poor"):
        assert main(_gen(chat_model_dir, "--spec", "chain", "--head", str(head), "--allow-other-target")) == 0


def test_data_inspect_sample_out_of_range_fails(tmp_path, chat_model_dir, capsys):
    from conftest import write_jsonl

    src = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{i}", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]} for i in range(5)])
    r = tmp_path / "r.yaml"
    r.write_text(f"target:\n  model: {chat_model_dir}\ndata:\n  source: {src}\n  heldout_fraction: 0.0\n")
    _fails(capsys, ["data", "inspect", str(r), "--sample", "999"], "--sample 999: out of range")


def test_a_huge_bad_value_is_not_echoed_whole(tmp_path, chat_model_dir, capsys):
    from conftest import write_jsonl

    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
            for i in range(4)]
    rows.append({"id": "bad", "conversations": [{"from": "x" * 100_000, "value": "hi"}]})
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    r = tmp_path / "r.yaml"
    r.write_text(f"target:\n  model: {chat_model_dir}\ndata:\n  source: {src}\n  heldout_fraction: 0.0\n")
    assert main(["data", "inspect", str(r), "--json"]) == 0
    out = capsys.readouterr()
    stats = json.loads(out.out)
    assert stats["skipped"] == {"unknown_role": 1}
    assert len(out.out) < 5000 and "x" * 100 not in out.out


def test_a_full_disk_while_saving_a_head_leaves_nothing(chat_model_dir, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    import headstart.heads.base as base

    def full(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(base, "save_file", full)
    out = tmp_path / "h"
    _fails(capsys, ["head", "init", "--type", "mtp", "--model", str(chat_model_dir), "--out", str(out)],
           "StorageFull")
    assert list(tmp_path.iterdir()) == []  # no half-written head, no temporary left behind
