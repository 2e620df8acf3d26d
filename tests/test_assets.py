import json

import pytest

from headstart import assets
from headstart.errors import AssetError


def test_unknown_names_list_the_embedded_ones(tmp_path):
    with pytest.raises(AssetError, match=r"unknown model 'nope'.*\['smollm2-135m'\]"):
        assets.resolve_model("nope")
    with pytest.raises(AssetError, match=r"unknown data source 'nope.jsonl'.*\['sharegpt'\]"):
        assets.resolve_data("nope.jsonl")


def test_local_paths_work_wherever_a_name_does(tmp_path, tiny_model_dir):
    assert assets.resolve_model(str(tiny_model_dir)) == tiny_model_dir
    f = tmp_path / "d.jsonl"
    f.write_text("{}\n")
    assert assets.resolve_data(str(f)) == f
    (tmp_path / "empty").mkdir()
    with pytest.raises(AssetError, match="no config.json"):
        assets.resolve_model(str(tmp_path / "empty"))


def test_packaged_file_reports_missing_distribution():
    with pytest.raises(AssetError, match="'no-such-dist-xyz' is not installed; run `make setup`"):
        assets.packaged_file("no-such-dist-xyz", "x.gguf")


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"


@pytest.mark.real
def test_embedded_smollm2_is_converted_once_and_reused():
    first = assets.prepare_model("smollm2-135m")
    again = assets.prepare_model("smollm2-135m")
    assert not again.converted_now and again.path_obj == first.path_obj
    cfg = json.loads((again.path_obj / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("llama", 30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and "quantization_config" not in cfg
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (again.path_obj / name).is_file(), name


@pytest.mark.real
def test_embedded_smollm2_weights_and_template():
    from safetensors import safe_open
    from transformers import AutoTokenizer

    path = assets.resolve_model("smollm2-135m")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
    assert tuple(emb.shape) == (49152, 576) and emb.abs().sum() > 0
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.real
def test_embedded_sharegpt_is_salvaged():
    report = assets.prepare_data("sharegpt")
    assert report.conversations == 17671
    assert 0 < report.bytes_unparsed < 100_000
    assert report.unparsed_at_byte + report.bytes_unparsed == report.bytes_total
    again = assets.prepare_data("sharegpt")
    assert not again.salvaged_now and again.conversations == 17671
    with open(report.path, encoding="utf-8") as f:
        first = json.loads(f.readline())
    assert first["id"] == "QWJhYvA_0" and first["conversations"][0]["from"] == "human"
