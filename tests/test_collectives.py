"""Every rank runs the same collectives whatever its data: 2-process gloo training runs (FSDP2 as the
8-GPU recipes use it, and DDP) on micro-batches chosen per rank to break that rule
(tests/collective_worker.py). Before the fixes each of these hung or trained a different head; a
rank left waiting fails after the worker's process-group timeout, and the test's own timeout bounds
the rest, so a regression fails the test instead of hanging the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("collective_worker.py")


def _launch(case: str, target: Path, out: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), case, str(target), str(out), *extra]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the 2-rank run did not finish in 400 s (a rank waits in a collective)")
    assert p.returncode == 0, f"{case}: the 2-rank run failed\n{p.stderr[-4000:]}"
    return torch.load(out)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tiny_models import make_hf_model

    d = tmp_path_factory.mktemp("collectives-llama")
    make_hf_model("llama", d)
    return d


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    from test_deepseek import CONFIGS, _hf_model

    kind, overrides = CONFIGS["v2-lite"]
    d = tmp_path_factory.mktemp("collectives-deepseek")
    _hf_model(kind, overrides).save_pretrained(d)
    return d


def test_fsdp_dflash_with_no_anchor_on_one_rank_trains(llama_dir, tmp_path):
    """Rank 1's micro-batches hold no sequence as long as a block: its zero loss must still run the
    head's forward, or rank 0 waits in an FSDP all-gather that rank 1 never joins."""
    got = _launch("dflash-no-anchor", llama_dir, tmp_path / "out.pt")
    assert got["step"] == 2 and all(torch.isfinite(v).all() for v in got["state"].values())


def test_moe_experts_without_tokens_on_one_rank_still_train(deepseek_dir, tmp_path):
    """A deepseek_mtp head with the target's MoE block, 7 rows per rank over 8 experts: some expert
    gets no token on one rank and some on the other. Every expert must take part (with zero rows):
    before, DDP's reducer stopped on the unused experts, and FSDP's reduce-scatter mixed up the ranks'
    gradients without a word. DDP and FSDP must train the same head."""
    ddp = _launch("moe-ddp", deepseek_dir, tmp_path / "ddp.pt")
    fsdp = _launch("moe-fsdp", deepseek_dir, tmp_path / "fsdp.pt")
    assert ddp["step"] == fsdp["step"] == 2 and ddp["skipped"] == fsdp["skipped"] == 0
    for name, want in ddp["state"].items():
        torch.testing.assert_close(fsdp["state"][name], want, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", ["chunks", "no-rows"])
def test_ranks_with_other_row_counts_run_the_same_loss_chunks(llama_dir, tmp_path, case):
    """mtp, TTT 3, loss chunks of 4 rows: rank 0 supervises enough rows for several chunks, rank 1 for one
    (chunks) or none (no-rows). The head's final norm is an FSDP unit that every chunk's logits gather:
    each rank must run the same number of chunks (empty ones where it has fewer rows), and FSDP then
    trains the head DDP trains."""
    ddp = _launch(f"{case}-ddp", llama_dir, tmp_path / "ddp.pt")
    fsdp = _launch(f"{case}-fsdp", llama_dir, tmp_path / "fsdp.pt")
    assert ddp["step"] == fsdp["step"] == 2
    for name, want in ddp["state"].items():
        torch.testing.assert_close(fsdp["state"][name], want, rtol=0, atol=1e-6, msg=name)


def test_fsdp_skipped_micro_batch_leaves_no_gradient_behind(llama_dir, tmp_path):
    """grad_accum 2 under FSDP: [a, b] is skipped because b is non-finite on rank 1, then [c, d] steps.
    The head must equal that of a run that saw only [c, d]: a's gradient, accumulated unsharded by
    FSDP outside .grad, must not leak into the step."""
    got = _launch("accumulate-fsdp", llama_dir, tmp_path / "out.pt")
    ref = _launch("accumulate-fsdp", llama_dir, tmp_path / "ref.pt", "--reference")
    assert got["step"] == ref["step"] == 1 and got["skipped"] == 1 and ref["skipped"] == 0
    for name, want in ref["state"].items():
        torch.testing.assert_close(got["state"][name], want, rtol=0, atol=1e-6, msg=name)
