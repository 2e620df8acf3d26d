"""A long-lived vLLM for work that feeds its outputs back in (regenerate: turn k+1's prompt holds
turn k's answer): one engine started once in vLLM's interpreter (`vllm_worker.py --serve`), asked
over a pipe, one JSON line per batch, each answer awaited with a timeout.

`VLLMGenerator` is what `headstart regenerate --engine vllm` decodes with: the engine's
`encode` / `generate` surface that regenerate uses, with prompts rendered by our tokenizer's chat
template (so both engines see the same tokens) and the text decoded by it as our engine does.
"""

from __future__ import annotations

import json
import selectors
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headstart.engines.vllm_runner import (
    DTYPES,
    START_TIMEOUT_S,
    TOKENS_PER_S_FLOOR,
    WORKER,
    Threads,
    VLLMError,
    _tail,
    end_group,
    vllm_missing,
    vllm_python,
    worker_env,
)


class VLLMSession:
    """`with VLLMSession(job, workdir) as s: s.generate(prompts, params)`; the worker's log is
    workdir/vllm.log. The engine runs in the worker's own process (no spawns)."""

    def __init__(self, job: dict[str, Any], workdir: Path, threads: Threads | None = None) -> None:
        why = vllm_missing()
        if why:
            raise VLLMError(why)
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "vllm.log"
        (workdir / "job.json").write_text(json.dumps(job))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(vllm_python()), "-P", str(WORKER), "--serve", str(workdir / "job.json")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=worker_env(job, threads, inprocess=True), bufsize=1, start_new_session=True)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._pending = False  # a batch was sent and its answer not read: the worker is busy with it
        self.method = self._read(START_TIMEOUT_S, "start").get("method")

    def _read(self, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise VLLMError(f"vLLM gave no answer to {what} within {timeout_s:.0f} s; its log: {self.log_path}\n"
                                + _tail(self.log_path))
            if self._sel.select(timeout=min(left, 5.0)):
                line = self.proc.stdout.readline()
                if line:
                    try:
                        return json.loads(line)
                    except ValueError:
                        self.close()
                        raise VLLMError(f"vLLM's worker answered {what} with {line[:80]!r}, not JSON; its log: "
                                        f"{self.log_path}\n" + _tail(self.log_path)) from None
            if self.proc.poll() is not None:
                self._log.close()
                raise VLLMError(f"vLLM stopped (exit {self.proc.returncode}) during {what}; its log: "
                                f"{self.log_path}\n" + _tail(self.log_path))

    def generate(self, prompts: list[list[int]], params: list[dict[str, Any]],
                 stop_token_ids: list[int]) -> list[dict[str, Any]]:
        tokens = sum(p["max_tokens"] for p in params)
        self.send(prompts, params, stop_token_ids)
        answer = self._read(START_TIMEOUT_S + tokens / TOKENS_PER_S_FLOOR, "a batch")["outputs"]
        self._pending = False
        return answer

    def send(self, prompts: list[list[int]], params: list[dict[str, Any]], stop_token_ids: list[int]) -> None:
        """Hand the worker a batch without waiting for its answer (`generate` waits)."""
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompts, "params": params,
                                              "stop_token_ids": stop_token_ids}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.close()
            raise VLLMError(f"vLLM's worker is gone; its log: {self.log_path}\n" + _tail(self.log_path)) from None
        self._pending = True

    def close(self) -> None:
        """An idle worker is told to stop (end of input) and waited for. A busy one, whose answer nobody
        will read (an interrupt or an error mid-batch), is ended at once: waiting for its batch could
        outlast the caller's own exit and leave vLLM computing for nobody."""
        if self.proc.poll() is None and self._pending:
            end_group(self.proc)
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                end_group(self.proc)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> VLLMSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class GeneratedText:
    """What regenerate reads of an engine's output."""
    token_ids: list[int]
    text: str
    finish_reason: str | None


class VLLMGenerator:
    """regenerate's engine surface (`encode`, `generate`, `model.fingerprint()`, `stop_ids`) on vLLM."""

    def __init__(self, model_dir: str | Path, dtype: str, max_batch_size: int, seed: int, workdir: Path,
                 max_model_len: int | None = None) -> None:
        from transformers import AutoTokenizer

        from headstart.models import load_target

        self.model = load_target(Path(model_dir), dtype="fp32", layers=[])  # the fingerprint, not the layers
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        cfg = self.model.config
        self.stop_ids = sorted(set(cfg.eos_token_ids) | ({self.tokenizer.eos_token_id}
                                                         if self.tokenizer.eos_token_id is not None else set()))
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        job = {"model": str(model_dir), "dtype": DTYPES[dtype], "max_model_len": self.max_model_len,
               "kv_cache_gb": 2, "engines": {"main": None}, "sampling": {"seed": seed}, "max_num_seqs": max_batch_size}
        self.session = VLLMSession(job, workdir)

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def generate(self, prompts: list[Any], params: list[Any]) -> list[GeneratedText]:
        ids = [self.encode(p) for p in prompts]
        for i, p in enumerate(ids):
            if len(p) + 1 > self.max_model_len:
                raise VLLMError(f"request {i}: the prompt has {len(p)} tokens; the model's context is "
                                f"{self.max_model_len}")
        reqs = [{"max_tokens": min(s.max_tokens, self.max_model_len - len(p)), "temperature": s.temperature,
                 "top_p": s.top_p, "seed": s.seed} for s, p in zip(params, ids)]
        outs = self.session.generate(ids, reqs, self.stop_ids)
        return [GeneratedText(o["token_ids"], self.tokenizer.decode(o["token_ids"], skip_special_tokens=True),
                              o["finish_reason"]) for o in outs]

    def close(self) -> None:
        self.session.close()
