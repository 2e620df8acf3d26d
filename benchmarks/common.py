"""Shared helpers for the benchmark scripts (prompts from the embedded ShareGPT, timing, training arms)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from headstart.assets import resolve_data
from headstart.data.sources import read_conversations


def sharegpt_prompts(n: int, max_chars: int = 1200, skip: int = 0) -> list[list[dict[str, str]]]:
    """The first user turn of the first n usable ShareGPT conversations (after `skip`), as chat messages."""
    firsts = []
    for conv in read_conversations(resolve_data("sharegpt"), limit=max(2000, 50 * (n + skip))).conversations:
        first = next(m for m in conv["messages"] if m["role"] == "user")
        if len(first["content"]) <= max_chars:
            firsts.append([first])
    if len(firsts) < n + skip:
        raise ValueError(f"only {len(firsts)} ShareGPT prompts of <= {max_chars} characters in the rows read")
    return firsts[skip:skip + n]


def timed(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def arm_result(arm_dir: Path, **setting: object) -> dict[str, object]:
    """A finished training arm's figures (its metrics.json) beside the setting it was trained with."""
    m = json.loads((arm_dir / "metrics.json").read_text())
    return {**setting, "tokens_seen": m.get("tokens"), "tau": m.get("tau"),
            "accept_rate_per_pos": m.get("accept_rate_per_pos"), "top1_per_step": m.get("top1_per_step"),
            "val_loss": m.get("val_loss")}


def print_arms(results: dict[str, dict[str, object]]) -> None:
    """One line per arm: steps, tokens, tau, acceptance per position, step-1 top-1."""
    print(f"{'arm':26}{'steps':>7}{'tokens':>12}{'tau':>8}  {'accept rate per position':26}{'top-1 (step 1)':>15}")
    for name, r in results.items():
        rate = "/".join(f"{v:.2f}" for v in r["accept_rate_per_pos"] or [])
        top1 = (r["top1_per_step"] or [float("nan")])[0]
        print(f"{name:26}{r['steps']:>7}{r['tokens_seen'] or 0:>12,}{r['tau']:>8.3f}  {rate:26}{top1:>15.3f}")


BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent


def headstart_cli(*args: str) -> None:
    """`headstart ARGS` in this interpreter, from the repository root; raises if it fails."""
    print("+ headstart", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "headstart.cli", *args], check=True, cwd=ROOT)


def train_arm(recipe: Path, run: Path, deadline: float | None) -> None:
    """Train (or continue from its last checkpoint) one run; with a deadline (time.monotonic(), from a script's
    --minutes), as much of it as the time left allows, then exit naming the command that continues it."""
    if (run / "head-final").exists():
        return
    box = []
    if deadline is not None:
        left = (deadline - time.monotonic()) / 60
        if left <= 0:
            raise SystemExit(f"--minutes: time is up before {run.name}; rerun the same command to continue")
        box = ["--minutes", repr(left)]  # not rounded: under 0.005 min "0.00" would be refused (> 0)
    headstart_cli("train", str(recipe), "--no-progress", *box,
                  *(["--resume"] if (run / "checkpoints" / "last.ckpt").exists() else []))
    if not (run / "head-final").exists():
        raise SystemExit(f"--minutes: {run.name} stopped at its time box (checkpointed); rerun the same command to "
                         "continue it")


@contextlib.contextmanager
def baseline_tree(rev: str) -> Iterator[Path]:
    """A git revision checked out into a temporary worktree (removed afterwards)."""
    root = BENCHMARKS.parent
    with tempfile.TemporaryDirectory(prefix="headstart-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=root, check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root, check=False)


def measure_in_tree(tree: Path, call: str, timeout: float, **env: str) -> Any:
    """`call` (an expression over this folder's modules, e.g. "moe.measure(512)") evaluated in a new process on
    the headstart package of `tree`; its JSON result."""
    module = call.split(".")[0]
    code = (f"import sys, json; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(BENCHMARKS)!r}); "
            f"import {module}; print('RESULT' + json.dumps({call}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), **env},
                       capture_output=True, text=True, timeout=timeout)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT")), None)
    if p.returncode or line is None:
        raise SystemExit(f"{tree}: the measurement failed\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT"):])


def cpu_name() -> str:
    """The CPU's model name (every benchmark figure is named with it)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
