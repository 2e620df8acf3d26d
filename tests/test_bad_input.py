"""Bad input and faults at the command line (issue: no data loss, no tracebacks, no memory bombs):
each case is one clear `headstart: error:` line and exit code 2."""

import json

import pytest
from conftest import fails_with_one_line

from headstart.cli import main

_fails = fails_with_one_line


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
    _fails(capsys, base + ["--type", "eagle3", "--postnorm-features"], "--postnorm-features applies to")
    assert main(base + ["--type", "mtp", "--postnorm-features"]) == 0
    assert json.loads((tmp_path / "h" / "config.json").read_text())["postnorm_features"] is True
    from headstart.heads import HeadConfig

    for kind in ("eagle3", "medusa", "draft_lm"):  # the config itself refuses it, whoever builds one
        with pytest.raises(ValueError, match="postnorm_features applies"):
            HeadConfig(head_type=kind, postnorm_features=True)


def test_damaged_heads_are_named(chat_model_dir, head_dir, capsys):
    cfg = head_dir / "config.json"
    good = cfg.read_text()
    for text, match in (("[1, 2]", "expected a JSON object"), ("{not json", "not valid JSON"),
                        # an edited size disagrees with the config the weights were saved with
                        (json.dumps({**json.loads(good), "num_layers": 10**9}), "num_layers is 1000000000 but the "
                                                                                "weights were saved with 1"),
                        (json.dumps({**json.loads(good), "intermediate_size": 10**12}), "intermediate_size")):
        cfg.write_text(text)
        err = _fails(capsys, _gen(chat_model_dir, "--spec", "chain", "--head", str(head_dir)), match)
        assert str(cfg) in err
    # A crafted head whose weights record the same huge size: the bounds refuse it before allocating.
    from safetensors.torch import load_file, save_file

    from headstart.fileio import sha256_file

    weights = head_dir / "model.safetensors"
    original = weights.read_bytes()
    huge = {k: v for k, v in json.loads(good).items()
            if k not in ("weights_sha256", "hidden_state_convention", "format")} | {"num_layers": 10**9}
    save_file(load_file(str(weights)), str(weights), metadata={"headstart_head_config": json.dumps(huge)})
    cfg.write_text(json.dumps({**json.loads(good), "num_layers": 10**9, "weights_sha256": sha256_file(weights)}))
    _fails(capsys, _gen(chat_model_dir, "--spec", "chain", "--head", str(head_dir)), "num_layers=1000000000 is outside")
    weights.write_bytes(original)
    cfg.write_text(good)
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

    import headstart.heads.checkpoint as checkpoint

    def full(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(checkpoint, "save_file", full)
    out = tmp_path / "h"
    _fails(capsys, ["head", "init", "--type", "mtp", "--model", str(chat_model_dir), "--out", str(out)],
           "StorageFull")
    assert list(tmp_path.iterdir()) == []  # no half-written head, no temporary left behind


def test_integrity_records_cannot_be_edited_away(chat_model_dir, tmp_path, capsys):
    """Deleting the fingerprint or the weights' sha256 from config.json, or editing what the head
    reads (aux ids), is refused by name instead of silently switching the check off."""
    head = tmp_path / "e3"
    assert main(["head", "init", "--type", "eagle3", "--model", str(chat_model_dir), "--out", str(head)]) == 0
    cfg = head / "config.json"
    good = json.loads(cfg.read_text())
    assert main(_gen(chat_model_dir, "--spec", "chain", "--head", str(head))) == 0
    capsys.readouterr()
    no_fp = {**good, "target": {k: v for k, v in good["target"].items() if k != "fingerprint"}}
    no_sha = {k: v for k, v in good.items() if k != "weights_sha256"}
    ids = good["aux_layer_ids"]
    edited = {**good, "aux_layer_ids": [ids[0] + 1 if ids[0] + 1 not in ids else ids[0] - 1] + ids[1:]}
    other_type = {**good, "target": {**good["target"], "model_type": "qwen3"}}
    null_dim = {**good, "intermediate_size": None}
    for bad, match in ((no_fp, "no target.fingerprint"), (no_sha, "no valid weights_sha256"),
                       (edited, "aux_layer_ids is"), (other_type, "target is"), (null_dim, "intermediate_size is")):
        cfg.write_text(json.dumps(bad))
        err = _fails(capsys, _gen(chat_model_dir, "--spec", "chain", "--head", str(head)), match)
        assert str(head) in err
        _fails(capsys, ["export", str(head), "--format", "native", "--model", str(chat_model_dir), "--out",
                        str(tmp_path / "x")], match)
    assert not (tmp_path / "x").exists()
    cfg.write_text(json.dumps(good))
    assert main(_gen(chat_model_dir, "--spec", "chain", "--head", str(head))) == 0
    # Weights without the record (or with one that is not an object), their sha256 updated to match.
    from safetensors.torch import load_file, save_file

    from headstart.fileio import sha256_file

    weights = head / "model.safetensors"
    state = load_file(str(weights))
    for meta, match in ((None, "no headstart_head_config record"), ({"headstart_head_config": "[1, 2]"},
                                                                    "not a JSON object")):
        save_file(state, str(weights), metadata=meta)
        cfg.write_text(json.dumps({**good, "weights_sha256": sha256_file(weights)}))
        _fails(capsys, _gen(chat_model_dir, "--spec", "chain", "--head", str(head)), match)


def test_import_checks_declared_sizes_and_index_paths(chat_model_dir, tmp_path, capsys):
    head = tmp_path / "h"
    assert main(["head", "init", "--type", "eagle1", "--model", str(chat_model_dir), "--out", str(head)]) == 0
    exp = tmp_path / "sg"
    assert main(["export", str(head), "--format", "sglang", "--model", str(chat_model_dir), "--out", str(exp)]) == 0
    capsys.readouterr()
    imp = ["import", str(exp), "--format", "sglang", "--target", str(chat_model_dir)]
    cfg = exp / "config.json"
    good = json.loads(cfg.read_text())
    # What SGLang builds its draft model from (twice the heads at the same width keeps every shape).
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        cfg.write_text(json.dumps({**good, key: good[key] * 2}))
        _fails(capsys, imp + ["--out", str(tmp_path / f"i-{key}")], f"{key}={good[key] * 2}")
        assert not (tmp_path / f"i-{key}").exists()
    for key, value in (("rms_norm_eps", 0.5), ("hidden_act", "gelu"), ("hidden_size", "64")):
        cfg.write_text(json.dumps({**good, key: value}))
        _fails(capsys, imp + ["--out", str(tmp_path / "i-x")], f"{key}={value}")
    cfg.write_text(json.dumps(good))
    # A safetensors index naming a file outside the checkpoint is refused before anything is read.
    outside = tmp_path / "elsewhere.safetensors"
    (exp / "model.safetensors").rename(outside)
    index = exp / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"fc.weight": "../elsewhere.safetensors"}}))
    _fails(capsys, imp + ["--out", str(tmp_path / "i-index")], "not a file directly inside")
    (exp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": str(outside)}}))
    _fails(capsys, imp + ["--out", str(tmp_path / "i-index")], "not a file directly inside")
    (exp / "model.safetensors.index.json").unlink()
    outside.rename(exp / "model.safetensors")
    assert main(imp + ["--out", str(tmp_path / "ok")]) == 0
