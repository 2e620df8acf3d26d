"""Runs inside vLLM's own interpreter (`.venv-vllm` or `$HEADSTART_VLLM_PYTHON`), never in headstart's:
vLLM pins its own transformers, so the two meet only through files. Standard library + vllm only.

    python vllm_worker.py JOB.json RESULT.json     # a batch of timed tasks (eval, tests, benchmarks)
    python vllm_worker.py --serve JOB.json         # a stream of requests on stdin, one JSON line each

JOB.json (written by headstart.engines.vllm_runner):
    model, dtype, max_model_len, kv_cache_gb, threads (null: vLLM's default binding)
    engines: {name: speculative_config dict or null}   # one vLLM LLM per name
    prompts: [[token ids], ...]                         # already chat-templated by headstart
    sampling: {max_tokens, temperature, seed, stop_token_ids}
    tasks: [{engine, prompts: [indices], temperature?}] # run in this order; timing is per task
An engine is started before its first task and shut down after its last, so a plain engine can
alternate with each speculative one while at most two are alive.

RESULT.json: per task the generated token ids, wall seconds, and the change of vLLM's own speculative
counters over the task (drafts, draft tokens, accepted tokens, accepted per position); per engine the
start-up seconds and the method vLLM resolved. Written to a temp name, then renamed.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def log(msg: str) -> None:
    print(f"vllm_worker: {msg}", file=sys.stderr, flush=True)


def counters(llm) -> dict:  # noqa: ANN001
    """vLLM's cumulative speculative counters, summed over label sets (one engine here)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] + [0] * len(vals), vals)] \
                if out["per_pos"] else vals
    return out


def delta(after: dict, before: dict) -> dict:
    pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0) for i, a in enumerate(after["per_pos"])]
    return {"drafts": after["drafts"] - before["drafts"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"], "accepted_per_pos": pos}


def start(job: dict, spec: dict | None):  # noqa: ANN201
    from vllm import LLM

    kwargs = {"model": job["model"], "dtype": job["dtype"], "max_model_len": job["max_model_len"],
              "enforce_eager": True, "disable_log_stats": False, "seed": job["sampling"]["seed"],
              "enable_prefix_caching": False}  # each task decodes from scratch, as our engine does
    if os.environ.get("HEADSTART_VLLM_INPROCESS") == "1":  # with VLLM_ENABLE_V1_MULTIPROCESSING=0: no spawns
        kwargs["distributed_executor_backend"] = "uni"
    if spec:
        kwargs["speculative_config"] = spec
    if job.get("max_num_seqs"):
        kwargs["max_num_seqs"] = job["max_num_seqs"]
    return LLM(**kwargs)


def method_of(llm) -> str | None:  # noqa: ANN001
    try:
        sc = llm.llm_engine.vllm_config.speculative_config
    except AttributeError:
        return None
    return getattr(sc, "method", None) if sc is not None else None


def generate(llm, job: dict, indices: list[int], temperature: float | None = None  # noqa: ANN001
             ) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    s = job["sampling"]
    params = [SamplingParams(temperature=s["temperature"] if temperature is None else temperature,
                             max_tokens=s["max_tokens"], seed=s["seed"] + i,
                             stop_token_ids=s["stop_token_ids"], detokenize=False) for i in indices]
    prompts = [TokensPrompt(prompt_token_ids=job["prompts"][i]) for i in indices]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def run(job: dict) -> dict:
    tasks = job["tasks"]
    last = {t["engine"]: i for i, t in enumerate(tasks)}
    alive: dict = {}
    engines: dict = {}
    results = []
    for i, task in enumerate(tasks):
        name = task["engine"]
        if name not in alive:
            log(f"starting engine {name!r}")
            t0 = time.perf_counter()
            llm = start(job, job["engines"][name])
            generate(llm, job, task["prompts"][:1])  # warm-up: first-call costs stay out of the timings
            alive[name] = llm
            engines[name] = {"startup_seconds": time.perf_counter() - t0, "method": method_of(llm)}
        llm = alive[name]
        before = counters(llm)
        outputs, seconds = generate(llm, job, task["prompts"], task.get("temperature"))
        results.append({"engine": name, "prompts": task["prompts"], "outputs": outputs, "seconds": seconds,
                        "spec": delta(counters(llm), before)})
        log(f"task {i + 1}/{len(tasks)} {name}: {sum(map(len, outputs))} tokens in {seconds:.2f}s")
        if last[name] == i:
            del alive[name], llm
            gc.collect()
    import vllm

    return {"vllm_version": vllm.__version__, "engines": engines, "tasks": results}


def serve(job: dict) -> int:
    """One engine (job["engines"]["main"]) fed as a stream: per stdin line one request {"id", "prompt":
    [ids], "params": {max_tokens, temperature, top_p, seed}, "stop_token_ids": [...]}, per finished request
    one stdout line {"id", "token_ids", "finish_reason"}, in the order they finish. Requests that arrive
    while others decode join the running batch at the next step (continuous batching), so the slots of
    the ones that finish are filled at once; end of input ends the worker once the last request is out.
    vLLM logs to stdout too: the protocol keeps the original stdout for itself and everything else (fd 1
    included, for C-level prints) goes to stderr."""
    import selectors

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm = start(job, job["engines"].get("main"))
    engine = llm.llm_engine
    proto.write(json.dumps({"ready": True, "method": method_of(llm)}) + "\n")
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    pending, reading = b"", True
    while reading or engine.has_unfinished_requests():
        busy = engine.has_unfinished_requests()
        while reading and sel.select(0 if busy else None):  # take what has come; wait only when idle
            chunk = os.read(0, 1 << 20)
            if not chunk:
                reading = False
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                req = json.loads(line)
                p = req["params"]
                params = SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"],
                                        top_p=p.get("top_p", 1.0), seed=p.get("seed"),
                                        stop_token_ids=req.get("stop_token_ids") or [], detokenize=False)
                params.output_kind = RequestOutputKind.FINAL_ONLY
                engine.add_request(str(req["id"]), TokensPrompt(prompt_token_ids=req["prompt"]), params)
            busy = True
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    proto.write(json.dumps({"id": out.request_id, "token_ids": list(out.outputs[0].token_ids),
                                            "finish_reason": out.outputs[0].finish_reason}) + "\n")
    return 0


def exit_with_parent(poll_s: float = 1.0) -> None:
    """End this worker (its whole process group when it leads one) once the headstart process that
    started it is gone. headstart names itself in HEADSTART_PARENT_PID; a headstart killed mid-batch
    (SIGKILL, a watchdog, a crash) cannot end us itself, and vLLM would go on computing for nobody
    until the batch ends. Nothing is watched when the variable is unset (the worker run by hand)."""
    want = os.environ.get("HEADSTART_PARENT_PID")
    if not want:
        return
    if not want.isdigit():
        log(f"HEADSTART_PARENT_PID={want[:20]!r} is not a PID: not watching for headstart's end")
        return

    def end() -> None:
        log(f"headstart (PID {want}) is gone: ending")
        if os.getpgrp() == os.getpid():  # started in a session of our own: vLLM's helpers go too
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    pid, first_parent = int(want), os.getppid()

    def gone() -> bool:
        if first_parent == pid and os.getppid() != pid:  # headstart started us itself, and we were reparented
            return True
        if os.path.isdir("/proc/self"):  # Linux: a zombie (dead, not yet reaped by its parent) has ended too
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except (FileNotFoundError, ProcessLookupError):
                return True
            except (OSError, IndexError):
                return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def watch() -> None:
        while not gone():
            time.sleep(poll_s)
        end()

    log(f"watching headstart (PID {want})")
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main() -> int:
    exit_with_parent()
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        with open(sys.argv[2]) as f:
            return serve(json.load(f))
    if len(sys.argv) != 3:
        print("usage: vllm_worker.py JOB.json RESULT.json | vllm_worker.py --serve JOB.json", file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = run(job)
    tmp = sys.argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
