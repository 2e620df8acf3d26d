"""A long-lived vLLM for work that feeds its outputs back in (regenerate: turn k+1's prompt holds
turn k's answer): one engine started once in vLLM's interpreter (`vllm_worker.py --serve`), asked
over a pipe, one JSON line per batch, each answer awaited with a timeout.

`VLLMGenerator` is what `headstart regenerate --engine vllm` decodes with: the engine's
`encode` / `generate` surface that regenerate uses, with prompts rendered by our tokenizer's chat
template (so both engines see the same tokens) and the text decoded by it as our engine does.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

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
    """`with VLLMSession(job, workdir) as s:`, then `s.submit(id, ...)` any time and `s.collect()` for the
    requests that have finished since: a stream, as our engine's add_request / step. The worker's log is
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
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=worker_env(job, threads, inprocess=True), start_new_session=True)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        # Requests are written without blocking, reading answers meanwhile (_send): a worker blocked writing
        # answers nobody reads takes no input, and a blocked write here would wait for it for ever.
        os.set_blocking(self.proc.stdin.fileno(), False)
        self._io = selectors.DefaultSelector()
        self._io.register(self.proc.stdin, selectors.EVENT_WRITE)
        self._io.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        self.in_flight: dict[str, int] = {}  # request id -> its max_tokens: sent, not yet answered
        self.method = self._read(START_TIMEOUT_S, "start").get("method")

    def _take(self) -> None:
        """What the worker has written (at least a byte: call when its output is readable) into the buffer."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
        if not chunk:  # end of its output: the worker is ending
            self.proc.wait(timeout=30)
            self._stopped()
        self._buf += chunk

    def _patience(self) -> float:
        """How long the worker may stay silent: a start, and every token in flight at the slowest rate."""
        return START_TIMEOUT_S + sum(self.in_flight.values()) / TOKENS_PER_S_FLOOR

    def _send(self, data: bytes) -> None:
        """data to the worker's input, its answers read into the buffer while the pipe is full. Gives up
        when neither moves for as long as collect waits (the worker takes input between vLLM's steps)."""
        view, fd = memoryview(data), self.proc.stdin.fileno()
        patience = self._patience()
        deadline = time.monotonic() + patience
        while view:
            events = self._io.select(timeout=5.0)
            for key, _ in events:
                if key.fileobj is self.proc.stdout:
                    self._take()
                    continue
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    continue
            if events:
                deadline = time.monotonic() + patience
            elif self.proc.poll() is not None:
                self._stopped()
            elif time.monotonic() > deadline:
                self.close()
                raise VLLMError(f"vLLM took no request and answered nothing for {patience:.0f} s; its log: "
                                f"{self.log_path}\n" + _tail(self.log_path))

    def _line(self, timeout_s: float) -> bytes | None:
        """One line of the worker's answers; None when none came within timeout_s (0: only one already here)."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if not self._sel.select(timeout=max(0.0, min(left, 5.0))):
                if self.proc.poll() is not None:
                    self._stopped()
                if left <= 0:
                    return None
                continue
            self._take()
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _stopped(self) -> NoReturn:
        self._log.close()
        raise VLLMError(f"vLLM stopped (exit {self.proc.returncode}); its log: {self.log_path}\n"
                        + _tail(self.log_path))

    def _read(self, timeout_s: float, what: str) -> dict[str, Any]:
        line = self._line(timeout_s)
        if line is None:
            self.close()
            raise VLLMError(f"vLLM gave no answer to {what} within {timeout_s:.0f} s; its log: {self.log_path}\n"
                            + _tail(self.log_path))
        return self._parse(line, what)

    def _parse(self, line: bytes, what: str) -> dict[str, Any]:
        try:
            return json.loads(line)
        except ValueError:
            self.close()
            raise VLLMError(f"vLLM's worker answered {what} with {line[:80]!r}, not JSON; its log: "
                            f"{self.log_path}\n" + _tail(self.log_path)) from None

    def submit(self, request_id: str, prompt: list[int], params: dict[str, Any], stop_token_ids: list[int]) -> None:
        """Hand the worker one request; it joins the running batch at vLLM's next step."""
        if request_id in self.in_flight:
            raise ValueError(f"request {request_id!r} is already with vLLM")
        try:
            self._send((json.dumps({"id": request_id, "prompt": prompt, "params": params,
                                    "stop_token_ids": stop_token_ids}) + "\n").encode())
        except OSError:  # a broken pipe: the worker is gone
            self.close()
            raise VLLMError(f"vLLM's worker is gone; its log: {self.log_path}\n" + _tail(self.log_path)) from None
        self.in_flight[request_id] = params["max_tokens"]

    def collect(self) -> list[dict[str, Any]]:
        """The requests finished since the last call ({"id", "token_ids", "finish_reason"}): waits for
        the first (as long as every token in flight may take at the slowest rate), takes the others that
        are already here."""
        if not self.in_flight:
            return []
        outs = [self._read(self._patience(), "a request")]
        while (line := self._line(0)) is not None:
            outs.append(self._parse(line, "a request"))
        for o in outs:
            if self.in_flight.pop(o.get("id"), None) is None:
                self.close()
                raise VLLMError(f"vLLM's worker answered request {o.get('id')!r}, which was not asked; its log: "
                                f"{self.log_path}")
        return outs

    def close(self) -> None:
        """An idle worker is told to stop (end of input) and waited for. A busy one, whose answers nobody
        will read (an interrupt or an error mid-batch), is ended at once: waiting for its batch could
        outlast the caller's own exit and leave vLLM computing for nobody."""
        if self.proc.poll() is None and self.in_flight:
            end_group(self.proc)
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                end_group(self.proc)
        if not self._log.closed:
            self._log.close()
        self._sel.close()
        self._io.close()

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
    """regenerate's engine surface (`encode`, `submit` / `collect`, `model.fingerprint()`, `stop_ids`) on vLLM."""

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

    def submit(self, request_id: str, messages: list[dict[str, str]], params: Any) -> None:
        """One conversation's next turn into the running batch (regenerate's stream)."""
        ids = self.encode(messages)
        if len(ids) + 1 > self.max_model_len:
            raise VLLMError(f"request {request_id!r}: the prompt has {len(ids)} tokens; the model's context is "
                            f"{self.max_model_len}")
        self.session.submit(request_id, ids, {"max_tokens": min(params.max_tokens, self.max_model_len - len(ids)),
                                              "temperature": params.temperature, "top_p": params.top_p,
                                              "seed": params.seed}, self.stop_ids)

    def collect(self) -> list[tuple[str, GeneratedText]]:
        """The turns finished since the last call, as (request id, text)."""
        return [(o["id"], self._text(o)) for o in self.session.collect()]

    def _text(self, out: dict[str, Any]) -> GeneratedText:
        return GeneratedText(out["token_ids"], self.tokenizer.decode(out["token_ids"], skip_special_tokens=True),
                             out["finish_reason"])

    def close(self) -> None:
        self.session.close()
