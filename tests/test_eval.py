"""`headstart eval` on a tiny fp32 target: AR and speculative runs on the same prompts, the report's
fields, determinism for a seed, `lossless_check: identical` at T = 0, categories, plots, the notebook."""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model

from headstart.errors import DataError, HeadstartError
from headstart.evaluate import EvalPlan, check_plan, evaluate, read_prompt_file, write_reports
from headstart.heads import HeadConfig, build_head, save_head
from headstart.models.llama import load_llama

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    make_hf_model("llama", d / "target", seed=4)
    target = load_llama(d / "target", "fp32")
    heads = []
    for kind in ("mtp", "medusa"):
        torch.manual_seed(0)
        save_head(build_head(HeadConfig(head_type=kind), target), d / kind)
        heads.append(str(d / kind))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 320, (int(n),), generator=g).tolist() for n in (5, 9, 14, 7, 11, 6)]
    return d, target, heads, prompts


def _report(setup, temps=(0.0, 1.0)):
    d, target, heads, prompts = setup
    plan = EvalPlan(heads=heads, ks=[1, 3], temperatures=list(temps), methods=["chain", "tree"], batch_size=4,
                    max_tokens=12, seed=5, tree_topk=2, tree_tokens=4)
    cats = ["code", "chat", "code", "chat", "math", None]
    return evaluate(target, None, prompts, cats, plan, progress=False, info={"target": "tiny", "dtype": "fp32"})


def test_eval_report_is_complete_deterministic_and_lossless_in_fp32(setup, tmp_path):
    a = _report(setup)
    runs = a["runs"]
    # mtp: chain and tree at k = 1, 3; medusa: its own method; two temperatures.
    assert len(runs) == 2 * (2 * 2 + 2)
    for r in runs:
        for key in ("tau", "alpha", "accept_rate_per_pos", "cond_accept_per_pos", "accept_histogram", "tokens_per_s",
                    "ar_tokens_per_s", "speedup", "tau_by_category"):
            assert key in r
        assert r["tau"] >= 1.0 and r["steps"] > 0 and r["speedup"] > 0
        assert sum(r["accept_histogram"]) == r["steps"]
        assert set(r["tau_by_category"]) <= {"code", "chat", "math"}
        if r["temperature"] == 0:
            assert r["lossless_check"] == "identical"
        if r["method"] == "chain":
            assert len(r["accept_rate_per_pos"]) == r["k"]
    assert {r["method"] for r in runs} == {"chain", "tree", "medusa"}
    b = _report(setup)
    strip = ("seconds", "tokens_per_s", "ar_tokens_per_s", "speedup")
    assert [{k: v for k, v in r.items() if k not in strip} for r in a["runs"]] == \
        [{k: v for k, v in r.items() if k not in strip} for r in b["runs"]]
    files = write_reports(a, tmp_path / "rep")
    names = {f.name for f in files}
    assert names == {"report.json", "report.md", "accept_per_position.png", "tau_speedup_by_k.png",
                     "tau_by_category.png"}
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["runs"][0]["head"] == runs[0]["head"]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| mtp | chain | 3 | 0.0 |" in md and "tau by prompt category" in md


def test_the_notebook_runs_on_reports(setup, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    a = _report(setup, temps=(0.0,))
    write_reports(a, tmp_path / "one")
    write_reports(a, tmp_path / "two")
    nb = nbformat.read(ROOT / "notebooks" / "acceptance.ipynb", as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(
        f"REPORTS = [{str(tmp_path / 'one' / 'report.json')!r}, {str(tmp_path / 'two' / 'report.json')!r}]"))
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)


def test_bad_eval_input(tmp_path):
    with pytest.raises(HeadstartError, match="--k"):
        check_plan(EvalPlan(heads=["x"], ks=[0]))
    with pytest.raises(HeadstartError, match="chain and/or tree"):
        check_plan(EvalPlan(heads=["x"], methods=["beam"]))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"text": "no"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: a row needs"):
        read_prompt_file(f)
    f.write_text('{"prompt": "hi"}\nnot json\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: not JSON"):
        read_prompt_file(f)
