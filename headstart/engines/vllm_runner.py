"""vLLM as a second engine: our heads exported, served and measured by vLLM itself.

vLLM is never imported here. It pins its own transformers, so it lives in its own interpreter
(`make vllm-env` -> `.venv-vllm`, or any vLLM named by `$HEADSTART_VLLM_PYTHON`, e.g. a CUDA vLLM
on a GPU node), and this module talks to it through files: a job (prompts as token ids, already
chat-templated by us, so both engines decode the same tokens) goes to `vllm_worker.py` in that
interpreter; the generated ids, wall times and vLLM's own speculative counters come back.

Which vLLM `method` serves which head family (vLLM 0.32, read in its config/speculative.py and run
on this CPU): eagle3 -> "eagle3" from our speculators export, dflash -> "dflash" from the same,
medusa -> "medusa" from our Medusa layout, draft_lm -> "draft_model" from a plain HF directory.
The method is always named: given a speculators directory without one, vLLM guesses it from the
directory's NAME and runs anything else as a draft model, which crashes.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headstart.errors import HeadstartError

PYTHON_ENV = "HEADSTART_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600.0  # per engine start: a cold start on 2 cores takes ~20-60 s
TOKENS_PER_S_FLOOR = 0.5  # the slowest decoding a job's timeout allows for

# head family -> (vLLM speculative method, our export format that vLLM reads for it)
METHODS = {"eagle3": ("eagle3", "vllm"), "eagle1": ("eagle", "vllm"),
           "dflash": ("dflash", "vllm"), "medusa": ("medusa", "medusa"),
           "draft_lm": ("draft_model", "hf")}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class VLLMError(HeadstartError):
    """vLLM is missing, refused a head, or its run failed (the message quotes its log's tail)."""


def vllm_python() -> Path | None:
    """The interpreter that runs vLLM: `$HEADSTART_VLLM_PYTHON`, else `.venv-vllm` in the checkout."""
    env = os.environ.get(PYTHON_ENV)
    if env:
        return Path(env)
    for base in (ROOT, Path.cwd()):
        p = base / ".venv-vllm" / "bin" / "python"
        if p.exists():
            return p
    return None


def vllm_missing() -> str | None:
    """None when vLLM can run here, else why not (one line, with the fix)."""
    py = vllm_python()
    if py is None:
        return f"no vLLM interpreter: run `make vllm-env` (creates .venv-vllm) or set {PYTHON_ENV}"
    if not py.exists():
        return f"{PYTHON_ENV}={str(py)[:200]}: no such file"
    try:
        run = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{py}: cannot run `import vllm` ({type(e).__name__}: {str(e)[:200]})"
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"{py}: `import vllm` fails: {last[:300]}"
    version = (run.stdout.strip().splitlines() or [""])[-1]
    if not version[:1].isdigit():
        return f"{py}: not a Python with vLLM (`import vllm; print(vllm.__version__)` printed {version[:60]!r})"
    return None


def vllm_refusal(head_type: str, head: Any = None) -> str | None:
    """None when vLLM serves this head family (and, given the head, the layout vLLM reads takes this
    head: an eagle1 head with an fc bias does not fit vLLM's drafter), else the one-line reason
    (checked before vLLM starts)."""
    if head_type in METHODS:
        if head is None:
            return None
        from headstart.export.formats import LAYOUTS

        return LAYOUTS[METHODS[head_type][1]].refuse(head)
    from headstart.export.serving import NOT_LOADED

    known = [why for (engine, _fmt, family), why in NOT_LOADED.items() if engine == "vLLM" and family == head_type]
    if known:
        return known[0]
    return (f"vLLM has no speculative method for a {head_type} head (it serves eagle3, eagle1, dflash, medusa and "
            "draft models from our exports)")


def max_k(head: Any) -> int | None:
    """The most draft tokens vLLM can take from this head (None: any)."""
    cfg = head.config
    if cfg.head_type == "medusa":
        return cfg.medusa_num_heads
    if cfg.head_type == "dflash":
        return cfg.block_size - 1
    return None


@dataclass
class Threads:
    """How vLLM's CPU worker binds its OpenMP threads. 'all': every core, as our engine uses them;
    'default': vLLM's own choice (on a 2-core box one core, the other reserved)."""
    mode: str = "all"

    def env(self) -> dict[str, str]:
        if self.mode == "default":
            return {}
        has = hasattr(os, "sched_getaffinity")
        cores = sorted(os.sched_getaffinity(0)) if has else list(range(os.cpu_count() or 1))
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def run_job(job: dict[str, Any], workdir: Path, *, threads: Threads | None = None, inprocess: bool = False,
            timeout_s: float | None = None, max_alive: int | None = 2) -> dict[str, Any]:
    """Run one job in vLLM's interpreter -> its result. `inprocess`: engine core and worker in the
    worker's own process (starts ~3x faster; then engines must not overlap in the task list).
    The log goes to workdir/vllm.log; a failure raises VLLMError with its tail."""
    why = vllm_missing()
    if why:
        raise VLLMError(why)
    _check_job(job, inprocess, max_alive)
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, result_file, log_file = workdir / "job.json", workdir / "result.json", workdir / "vllm.log"
    result_file.unlink(missing_ok=True)
    job_file.write_text(json.dumps(job))
    env = worker_env(job, threads, inprocess)
    if timeout_s is None:
        tokens = sum(len(t["prompts"]) for t in job["tasks"]) * job["sampling"]["max_tokens"]
        timeout_s = START_TIMEOUT_S * len(job["engines"]) + tokens / TOKENS_PER_S_FLOOR
    cmd = [str(vllm_python()), "-P", str(WORKER), str(job_file), str(result_file)]
    with open(log_file, "w") as log:
        # its own process group: a timeout ends vLLM's engine-core and worker processes with it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_group(proc)
            raise VLLMError(f"vLLM did not finish within {timeout_s:.0f} s; its log: {log_file}\n"
                            + _tail(log_file)) from None
        except BaseException:  # Ctrl-C: vLLM's processes go too
            end_group(proc)
            raise
    if proc.returncode != 0 or not result_file.exists():
        raise VLLMError(f"vLLM failed (exit {proc.returncode}); its log: {log_file}\n" + _tail(log_file))
    return json.loads(result_file.read_text())


def worker_env(job: dict[str, Any], threads: Threads | None, inprocess: bool) -> dict[str, str]:
    """The environment vLLM's interpreter runs in: its KV cache size, thread binding, in-process
    engine core, and Intel OpenMP preloaded as vLLM's CPU docs ask (it warns of a "significant
    performance loss" for speculative decoding without it)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # our interpreter's paths must not leak into vLLM's
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gb", 1)))
    env.update((threads or Threads()).env())
    env["HEADSTART_VLLM_INPROCESS"] = "1" if inprocess else "0"
    env["HEADSTART_PARENT_PID"] = str(os.getpid())  # the worker ends itself once we are gone
    if inprocess:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    iomp = Path(str(vllm_python())).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    return env


def end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group, SIGKILL after a grace period; reaped either way."""
    import signal

    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _alive(tasks: list[dict[str, Any]]) -> int:
    """The most engines alive at once (each lives from its first task to its last)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, t in enumerate(tasks):
        first.setdefault(t["engine"], i)
        last[t["engine"]] = i
    return max((sum(first[e] <= i <= last[e] for e in first) for i in range(len(tasks))), default=0)


def _check_job(job: dict[str, Any], inprocess: bool, max_alive: int | None = None) -> None:
    missing = {"model", "dtype", "max_model_len", "engines", "prompts", "sampling", "tasks"} - set(job)
    if missing:
        raise ValueError(f"vLLM job without {sorted(missing)}")
    for t in job["tasks"]:
        if t["engine"] not in job["engines"]:
            raise ValueError(f"vLLM job: task names engine {t['engine']!r}, which the job does not define")
        if any(not 0 <= i < len(job["prompts"]) for i in t["prompts"]) or not t["prompts"]:
            raise ValueError("vLLM job: a task's prompt indices must be non-empty and within the prompts")
    if max_alive is not None and _alive(job["tasks"]) > max_alive:
        raise ValueError(f"vLLM job: {_alive(job['tasks'])} engines alive at once (at most {max_alive}: vLLM's "
                         "metrics registry is global, and each engine holds its own KV cache)")
    if inprocess:  # one engine alive at a time: each engine's tasks must be contiguous
        seen: list[str] = []
        for t in job["tasks"]:
            if not seen or seen[-1] != t["engine"]:
                if t["engine"] in seen:
                    raise ValueError(f"vLLM job: in-process engines cannot alternate ({t['engine']!r} comes back)")
                seen.append(t["engine"])


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    keep = [s for s in text if "Error" in s or "error" in s or "Traceback" in s or "vllm_worker" in s][-lines:]
    return "\n".join(s[:300] for s in (keep or text[-lines:]))


def acceptance(spec: dict[str, Any], k: int) -> dict[str, Any]:
    """vLLM's counters over a run -> our metric names (DESIGN §1). accepted_per_pos[i] counts the
    drafts whose first i+1 tokens were accepted, so the histogram of accepted lengths follows."""
    n = spec["drafts"]
    per_pos = (list(spec["accepted_per_pos"]) + [0] * k)[:k]
    if n == 0:
        return {"steps": 0, "tau": None, "alpha": None, "accept_rate_per_pos": [0.0] * k,
                "cond_accept_per_pos": [0.0] * k, "accept_histogram": [0] * (k + 1)}
    rates = [c / n for c in per_pos]
    cond = [rates[0]] + [rates[i] / rates[i - 1] if rates[i - 1] else 0.0 for i in range(1, k)]
    at_least = [n] + per_pos
    hist = [at_least[a] - (at_least[a + 1] if a < k else 0) for a in range(k + 1)]
    return {"steps": n, "tau": 1 + spec["accepted"] / n,
            "alpha": spec["accepted"] / spec["draft_tokens"] if spec["draft_tokens"] else None,
            "accept_rate_per_pos": rates, "cond_accept_per_pos": cond, "accept_histogram": hist}


__all__ = ["METHODS", "PYTHON_ENV", "Threads", "VLLMError", "acceptance", "end_group", "max_k", "run_job",
           "vllm_missing",
           "vllm_python", "vllm_refusal", "worker_env"]
