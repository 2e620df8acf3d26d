"""`headstart eval` on a tiny fp32 target: AR and speculative runs on the same prompts, the report's
fields, determinism for a seed, `lossless_check: identical` at T = 0, categories, plots, the notebook."""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model

from headstart.errors import DataError, HeadstartError
from headstart.eval_report import write_reports
from headstart.evaluate import EvalPlan, check_plan, evaluate, read_prompt_file
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
    # mtp: chain and tree at k = 1, 3; medusa: its own method; the ngram baseline; two temperatures.
    assert len(runs) == 2 * (2 * 2 + 2 + 2)
    for r in runs:
        for key in ("tau", "alpha", "accept_rate_per_pos", "cond_accept_per_pos", "accept_histogram", "tokens_per_s",
                    "ar_tokens_per_s", "speedup", "tau_by_category"):
            assert key in r
        hist, n = r["accept_histogram"], r["steps"]
        assert n > 0 and sum(hist) == n and r["speedup"] > 0
        # The summary numbers are the histogram's (docs/acceptance.md), not computed some other way.
        assert r["tau"] == pytest.approx(1 + sum(a * c for a, c in enumerate(hist)) / n)
        assert r["accept_rate_per_pos"] == pytest.approx([sum(hist[i + 1:]) / n for i in range(len(hist) - 1)])
        assert set(r["tau_by_category"]) <= {"code", "chat", "math"}
        if r["temperature"] == 0:
            assert r["lossless_check"] == "identical"
        if r["method"] == "chain":
            assert len(r["accept_rate_per_pos"]) == r["k"]
        assert r["speedup_min"] <= r["speedup"] <= r["speedup_max"] and r["timing_pairs"] == 2  # 6 prompts, batch 4
    assert {r["method"] for r in runs} == {"chain", "tree", "medusa", "ngram"}
    assert {r["label"] for r in runs if r["method"] == "ngram"} == {"ngram (no training)"}
    b = _report(setup)
    strip = ("seconds", "tokens_per_s", "ar_tokens_per_s", "speedup", "speedup_min", "speedup_max", "speedup_spread",
             "speedup_p25", "speedup_p75", "draft_ms_per_step", "verify_ms_per_step")
    assert all(r["draft_ms_per_step"] >= 0 and r["verify_ms_per_step"] > 0 for r in a["runs"])
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
    with pytest.raises(HeadstartError, match="chain, tree and/or adaptive"):
        check_plan(EvalPlan(heads=["x"], methods=["beam"]))
    with pytest.raises(HeadstartError, match="--repeats"):
        check_plan(EvalPlan(heads=["x"], repeats=0))
    with pytest.raises(HeadstartError, match="--draft-threshold"):
        check_plan(EvalPlan(heads=["x"], draft_threshold=float("nan")))
    for bad in ({"tree_tokens": 0}, {"tree_tokens": 10**6}, {"tree_topk": 0}):
        with pytest.raises(HeadstartError, match="--tree-tokens"):
            check_plan(EvalPlan(heads=["x"], **bad))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"text": "no"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: a row needs"):
        read_prompt_file(f)
    f.write_text('{"prompt": "hi"}\nnot json\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: not JSON"):
        read_prompt_file(f)


def test_summary_numbers_from_known_per_request_metrics():
    """Pooled tau / alpha / rates / histogram / per-category tau / speedup / lossless from known inputs."""
    from types import SimpleNamespace

    from headstart.evaluate import _Setting, _summarise

    def out(hist, ids):
        return SimpleNamespace(spec_metrics={"accept_histogram": hist}, token_ids=ids)

    # request 1: a = 0, 3, 3; request 2: a = 1, 2; request 3: no step.
    outs = [out([1, 0, 0, 2], [1, 2, 3]), out([0, 1, 1, 0], [4, 5]), out([0, 0, 0, 0], [6])]
    ar = {"outputs": [[1, 2, 3], [4, 9], [6]]}
    head = SimpleNamespace(config=SimpleNamespace(head_type="mtp"))
    st = _Setting("h", "h", head, "chain", 3)
    timed = {"outputs": outs, "tokens": 6, "seconds": 1.0, "ar_tokens_per_s": 3.0, "ratios": [2.5, 1.5, 2.0]}
    r = _summarise(st, 0.0, timed, ["a", "b", "a"], ar)
    assert r["steps"] == 5 and r["tau"] == pytest.approx(1 + 9 / 5) and r["alpha"] == pytest.approx(9 / 15)
    assert r["accept_histogram"] == [1, 1, 1, 2]
    assert r["accept_rate_per_pos"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert r["cond_accept_per_pos"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert r["tau_by_category"] == pytest.approx({"a": 1 + 6 / 3, "b": 1 + 3 / 2})
    assert r["tokens_per_s"] == 6.0 and r["speedup"] == pytest.approx(2.0)  # the median of the ratios
    assert (r["speedup_min"], r["speedup_max"]) == pytest.approx((1.5, 2.5))
    assert (r["speedup_p25"], r["speedup_p75"], r["speedup_spread"]) == pytest.approx((1.75, 2.25, 0.25))
    assert r["lossless_check"] == "differs in 1 of 3"
    assert "lossless_check" not in _summarise(st, 1.0, timed, [None] * 3, ar)
    assert _summarise(st, 1.0, {**timed, "ratios": [1.0, 3.0]}, [None] * 3, ar)["speedup"] == 2.0


def test_plain_and_speculative_runs_alternate_per_group(monkeypatch):
    """Timing pairs: AR then spec on each batch group, the order flipped on the next repeat, so a load
    change between two runs moves both sides of a ratio; each ratio uses its own pair's times."""
    from types import SimpleNamespace

    import headstart.evaluate as ev

    calls, clock = [], iter([2.0, 1.0, 1.0, 4.0, 2.0, 1.0, 1.0, 4.0])  # seconds per call, in call order

    def fake_run(engine, prompts, first, temp, plan):
        calls.append((engine, first))
        return [SimpleNamespace(token_ids=[1] * 10, spec_metrics=None) for _ in prompts], next(clock)

    monkeypatch.setattr(ev, "_run", fake_run)
    plan = EvalPlan(heads=["x"], batch_size=2, repeats=2)
    timed = ev._timed_setting("AR", "SPEC", [[1]] * 4, 0.0, plan, lambda n: None)
    assert calls == [("AR", 0), ("SPEC", 0), ("SPEC", 0), ("AR", 0), ("AR", 2), ("SPEC", 2), ("SPEC", 2), ("AR", 2)]
    assert timed["ratios"] == [2.0, 4.0, 2.0, 4.0]  # (AR s / spec s) per pair
    assert len(timed["outputs"]) == 4 and len(timed["ar_outputs"]) == 4  # the first repeat's


def test_more_bad_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    for body, match in [('{"messages": ["hi"]}\n', r":1: \"messages\" must be"),
                        ('{"prompt": "ok"}\n{"prompt": "x", "category": ["a"]}\n', r":2: \"category\" must be"),
                        ('{"prompt": ""}\n', r":1: a row needs a non-empty")]:
        f.write_text(body)
        with pytest.raises(DataError, match=match):
            read_prompt_file(f)
    f.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: not UTF-8"):
        read_prompt_file(f)
