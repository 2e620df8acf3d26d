import json
import subprocess
import sys

import pytest
from conftest import write_jsonl

from headstart.cli import main


def test_help_lists_the_verbs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "assets" in out and "data" in out


def test_console_script_is_installed():
    from pathlib import Path

    script = Path(sys.executable).parent / "headstart"  # the entry point pip installed beside python
    r = subprocess.run([str(script), "data", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "inspect" in r.stdout


@pytest.fixture
def recipe(tmp_path, tiny_model_dir):
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"hi {i}"},
                                              {"from": "gpt", "value": f"hello {i}"},
                                              {"from": "human", "value": "more"},
                                              {"from": "gpt", "value": "sure"}]} for i in range(30)]
    rows.append({"conversations": [{"from": "gpt", "value": "orphan reply"}]})
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    p = tmp_path / "r.yaml"
    p.write_text(f"target:\n  model: {tiny_model_dir}\ndata:\n  source: {src}\n  heldout_fraction: 0.2\n")
    return p


def test_data_inspect_json(recipe, capsys):
    assert main(["data", "inspect", str(recipe), "--json", "--limit", "20"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["conversations"] == 20 and stats["skipped"] == {}
    assert stats["tokens"] > stats["supervised_tokens"] > 0
    assert main(["data", "inspect", str(recipe), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["rows_read"] == 31 and stats["skipped"] == {"starts_with_assistant": 1}


def test_data_inspect_text_marks_the_sample(recipe, capsys):
    assert main(["data", "inspect", str(recipe), "--set", "data.max_length=200"]) == 0
    out = capsys.readouterr().out
    assert "supervised tokens" in out and "starts_with_assistant 1" in out
    assert "⟦hello" in out and "⟦sure<|im_end|>⟧" in out


def test_errors_are_one_line_without_traceback(recipe, tmp_path, capsys):
    assert main(["data", "inspect", str(recipe), "--set", "data.max_lenght=5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("headstart: error: --set data.max_lenght") and "Traceback" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("target:\n  model: /does/not/exist\n")
    assert main(["data", "inspect", str(bad)]) == 2
    assert "unknown model '/does/not/exist'" in capsys.readouterr().err


@pytest.mark.real
def test_quickstart_recipe_inspect_on_real_data(capsys):
    assert main(["data", "inspect", "recipes/smollm2-135m-mtp.yaml", "--set", "data.source=sharegpt", "--limit", "200",
                 "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["rows_read"] == 200
    assert stats["conversations"] + sum(stats["skipped"].values()) == 200
    assert stats["supervised_tokens"] > 10_000 and stats["unparsed_tail_bytes"] > 0


def test_head_init_never_deletes_a_user_directory(chat_model_dir, tmp_path, capsys):
    runs = tmp_path / "runs" / "x"
    victim = runs / "victim"
    victim.mkdir(parents=True)
    (victim / "notes.txt").write_text("precious")
    (runs / "sibling.txt").write_text("keep")
    init = ["head", "init", "--type", "mtp", "--model", str(chat_model_dir), "--out"]
    for out in (victim, f"{victim}/..", "."):
        assert main(init + [str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("headstart: error:") and "Traceback" not in err
    assert (victim / "notes.txt").read_text() == "precious" and (runs / "sibling.txt").read_text() == "keep"
    head = tmp_path / "head"
    assert main(init + [str(head)]) == 0
    assert main(init + [str(head)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(init + [str(head), "--force"]) == 0  # a recognised head checkpoint may be replaced
    assert main(init + [str(victim), "--force"]) == 2  # --force never replaces what is not a head
    assert (victim / "notes.txt").read_text() == "precious"


@pytest.mark.real
def test_json_verbs_print_one_document_on_a_cold_cache(tmp_path):
    """A new machine: the first use converts the model and salvages the data set. Those status lines
    go to stderr; stdout holds exactly one JSON document (run as a user runs it: a subprocess)."""
    import os

    env = {**os.environ, "HEADSTART_CACHE": str(tmp_path / "cold")}

    def run(*argv: str) -> tuple[dict, str]:
        done = subprocess.run([sys.executable, "-m", "headstart.cli", *argv], env=env, capture_output=True,
                              text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout), done.stderr

    stats, err = run("data", "inspect", "recipes/quickstart.yaml", "--limit", "50", "--json")
    assert stats["rows_read"] == 50
    assert "converting" in err and "element by element" in err  # the cache really was cold
    report, _ = run("assets", "--json")
    assert [m["converted_now"] for m in report["models"]] == [False]


def test_quickstart_summary_says_where_each_evaluated_head_serves(chat_model_dir, tmp_path, capsys):
    """`make quickstart`'s last lines: each head of the eval report with the engines that load it, as
    `headstart plan` says (an mtp head on a Llama-family target: ours only; an EAGLE-3.1 head: all)."""
    import json

    from headstart.heads import HeadConfig, build_head, save_head
    from headstart.models.llama import load_llama
    from headstart.quickstart_summary import main as summary

    target = load_llama(chat_model_dir, "fp32")
    heads = {"mtp": HeadConfig(head_type="mtp"),
             "eagle31": HeadConfig(head_type="eagle3", aux_layer_ids=[1, 2], norm_before_fc=False, fc_norm=True,
                                   norm_before_residual=False, norm_output=True)}
    runs = []
    for name, cfg in heads.items():
        save_head(build_head(cfg, target), tmp_path / name / "head-best")
        runs.append({"head": str(tmp_path / name / "head-best"), "method": "chain", "k": 3, "tau": 1.5,
                     "speedup": 1.2})
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text(json.dumps(
        {"runs": runs, "ar": {"0.0": {"tokens_per_s": 40.0}}, "prompts": 4,
         "settings": {"target": str(chat_model_dir), "dtype": "fp32"}}))
    (tmp_path / "metrics.json").write_text(json.dumps({"step": 2, "tokens": 100, "tau": 1.4}))
    assert summary(str(tmp_path)) == 0
    out = capsys.readouterr().out
    lines = {name: next(x for x in out.splitlines() if x.strip().startswith(f"{name}/head-best") and "vLLM" in x)
             for name in heads}
    assert "vLLM: no" in lines["mtp"] and "SGLang: no" in lines["mtp"] and "headstart: yes" in lines["mtp"]
    assert "vLLM: yes (--format vllm)" in lines["eagle31"] and "SGLang: yes (--format sglang)" in lines["eagle31"]
