"""benchmarks/gpu_check.sh --cpu: the GPU check's dry run (every step of the CUDA run at tiny shapes on
CPU, the CUDA-only ones skipped) passes here, and a failing step is recorded without stopping the rest.
Random models and conversations built by the script; no embedded assets. About 3 minutes on 2 cores."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
RAN = ["setup", "inputs", "plan", "precompute", "train", "eval", "export", "deepseek-auto", "deepseek-refusal"]
SKIPPED = ["flashinfer", "cuda-tests"]


def _run(tmp_path: Path, python: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--cpu", "--out", str(tmp_path / "out"), "--python", python],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def _statuses(stdout: str) -> dict[str, str]:
    """The step lines printed as each step ends: 'PASS train (45s): ...'."""
    return {m[2]: m[1] for m in re.finditer(r"^(PASS|FAIL|SKIP) (\S+) \(\d+s\)", stdout, re.M)}


def test_the_cpu_dry_run_passes_every_step(tmp_path):
    p = _run(tmp_path, sys.executable, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    statuses = _statuses(p.stdout)
    assert statuses == {**{s: "PASS" for s in RAN}, **{s: "SKIP" for s in SKIPPED}}, p.stdout[-4000:]
    assert "gpu_check: no step failed" in p.stdout
    # the summary table, and the measured peaks beside the plan's phases
    assert re.search(r"^PASS\s+train\s+\d+\s+step 20,", p.stdout, re.M), p.stdout[-3000:]
    assert re.search(r"^train\s.*train [\d.]+ / validation [\d.]+$", p.stdout, re.M), p.stdout[-3000:]
    assert re.search(r"^eval\s.*eval [\d.]+$", p.stdout, re.M), p.stdout[-3000:]
    # on CPU the bytes a micro-batch keeps for backward, beside the plan's activation terms, within them
    assert re.search(r"^train saved\s+[\d.]+\s.*\(bytes one micro-batch keeps for backward\)$", p.stdout, re.M), \
        p.stdout[-3000:]
    assert "bytes/token measured" in p.stdout
    runs = list((tmp_path / "out").glob("cpu-*"))
    assert len(runs) == 1 and (runs[0] / "llama" / "head-final" / "config.json").is_file()
    assert (runs[0] / "export" / "sglang" / "config.json").is_file()
    assert (runs[0] / "export" / "vllm" / "config.json").is_file()


def test_a_failing_step_is_recorded_and_the_others_still_run(tmp_path):
    """An interpreter that fails every command: each step reports FAIL (none is skipped over), the
    summary lists them all and the exit status is 1."""
    p = _run(tmp_path, "/bin/false", timeout=300)
    assert p.returncode == 1, p.stdout[-3000:]
    statuses = _statuses(p.stdout)
    assert statuses == {**{s: "FAIL" for s in RAN}, **{s: "SKIP" for s in SKIPPED}}, p.stdout[-3000:]
    assert f"gpu_check: {len(RAN)} step(s) FAILED" in p.stdout
    summary = p.stdout.split("== summary", 1)[1]
    assert all(re.search(rf"^FAIL\s+{s}\s", summary, re.M) for s in RAN)


def test_the_table_fails_when_a_measured_peak_exceeds_the_plan(tmp_path, capsys):
    """The check exists to catch what `plan` does not count: a peak above the planned phase is a failure."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    (tmp_path / "peaks").mkdir()
    (tmp_path / "plan.json").write_text(json.dumps({"recipe": "r", "device": "H200", "phases": [
        {"name": "train", "total": 40e9}, {"name": "validation", "total": 30e9}, {"name": "eval", "total": 20e9}]}))
    (tmp_path / "peaks" / "train.json").write_text(json.dumps({"gpu_max_allocated_gb": 39.0}))
    (tmp_path / "peaks" / "eval.json").write_text(json.dumps({"gpu_max_allocated_gb": 19.5}))
    assert gpu_check.main(["table", str(tmp_path)]) == 0
    (tmp_path / "peaks" / "eval.json").write_text(json.dumps({"gpu_max_allocated_gb": 21.0}))
    assert gpu_check.main(["table", str(tmp_path)]) == gpu_check.OVER_PLAN
    out = capsys.readouterr().out
    assert re.search(r"^eval\s.*OVER PLAN$", out, re.M) and "eval 21.000 GB > planned 20.000 GB" in out
    assert not re.search(r"^train\s.*OVER PLAN", out, re.M)
    # the CPU dry run's measure: the bytes one micro-batch keeps against the plan's activation terms
    (tmp_path / "peaks" / "eval.json").write_text(json.dumps({"gpu_max_allocated_gb": 19.5}))
    terms = [{"name": "target weights", "bytes": 30e9}, {"name": "head activations", "bytes": 2e9},
             {"name": "TTT attention (padded rows)", "bytes": 1e9}]
    (tmp_path / "plan.json").write_text(json.dumps({"recipe": "r", "device": "CPU RAM", "phases": [
        {"name": "train", "total": 40e9, "terms": terms}]}))
    for kept, status in ((2.9, 0), (3.1, gpu_check.OVER_PLAN)):
        (tmp_path / "peaks" / "train.json").write_text(json.dumps({"saved_max_gb": kept}))
        assert gpu_check.main(["table", str(tmp_path)]) == status
    assert "train saved 3.100 GB > planned activations 3.000 GB" in capsys.readouterr().out


def test_bad_options_are_one_line_before_any_step(tmp_path):
    """A missing --python / --wheels, an absurd --budget and an unknown --only step: exit 2 with one line, no
    step run."""
    import subprocess

    for args, said in ((["--python", str(tmp_path / "nope")], "--python"), (["--wheels", str(tmp_path / "nope")],
                       "--wheels"), (["--budget", "99999999999"], "--budget 99999999999: at most 86400"),
                       (["--budget", "1h"], "--budget takes whole seconds"),
                       (["--only", "train,cuda_tests"], "--only: no step 'cuda_tests'")):
        p = subprocess.run(["bash", str(SCRIPT), "--cpu", "--out", str(tmp_path / "out"), *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)
        assert "FAIL" not in p.stdout


def test_only_runs_the_steps_named(tmp_path):
    """--only: the steps named (and setup), nothing else in the summary; the dry run's models are built."""
    p = subprocess.run(["bash", str(SCRIPT), "--cpu", "--out", str(tmp_path / "out"), "--python", sys.executable,
                        "--only", "inputs,deepseek-refusal"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert _statuses(p.stdout) == {"setup": "PASS", "inputs": "PASS", "deepseek-refusal": "PASS"}, p.stdout[-3000:]
