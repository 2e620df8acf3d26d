"""The engine: a target model, a paged KV cache, the scheduler and the sampler, stepped together.

    engine = Engine("smollm2-135m", dtype="bf16")
    outs = engine.generate(["Write a haiku about the sea"], SamplingParams(max_tokens=64))

`add_request` / `step` / `abort` give continuous batching to callers that feed requests over time.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from headstart.inference.backends import make_backend
from headstart.inference.detok import IncrementalText
from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator, pages_for_budget
from headstart.inference.ngram import NgramProposer
from headstart.inference.outputs import EngineStats, RequestOutput
from headstart.inference.proposers import (
    BlockProposer,
    DraftModelProposer,
    HeadChainProposer,
    MedusaProposer,
    draft_kv_spec,
)
from headstart.inference.runner import ModelRunner
from headstart.inference.sampler import SamplingParams, sample, token_logprobs
from headstart.inference.scheduler import DEFAULT_BATCHED_TOKENS, Scheduler, Sequence, Status
from headstart.inference.spec_step import SpeculativeStep, resolve_draft
from headstart.inference.speculation import SpecConfig, SpecMetrics
from headstart.inference.tree import TreeProposer
from headstart.kernels import FAST_ROWS, fast_linear_rows
from headstart.models import CausalLM, load_target
from headstart.nn.linear import enable_cpu_kernels

Prompt = str | list[dict[str, str]] | list[int]


class Engine:
    def __init__(
        self,
        model: str | Path | CausalLM,
        *,
        tokenizer: Any | None = None,
        dtype: str = "bf16",
        device: str | torch.device = "cpu",
        backend: str = "auto",
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_gb: float | None = None,
        max_batch_size: int = 32,
        max_batched_tokens: int = DEFAULT_BATCHED_TOKENS,
        seed: int = 0,
        cpu_kernels: bool = True,
        batch_invariant: bool = True,
        spec: SpecConfig | None = None,
        prefix_cache: bool = False,
    ) -> None:
        for name, value in (("page_size", page_size), ("max_batch_size", max_batch_size),
                            ("max_batched_tokens", max_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if num_pages is not None and num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if prefix_cache and spec is not None:  # drafts rewrite and move K/V slots a shared page would hold
            raise ValueError("prefix_cache is for engines without speculation (the draft's cache shares the page ids)")
        self.device = torch.device(device)
        if isinstance(model, CausalLM):
            self.model = model
            if tokenizer is None and model.source_dir is not None and (model.source_dir / "tokenizer.json").exists():
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(model.source_dir))
        else:
            from headstart.assets import resolve_model

            model_dir = resolve_model(model)
            self.model = load_target(model_dir, dtype=dtype, device=self.device)
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer = tokenizer
        # CPU: the row-invariant kernels (headstart.kernels) for every matmul and attention row when
        # batch_invariant (a token's logits never depend on what shares its step or where its prompt
        # was chunked: greedy speculation equals greedy AR), else only where they are the faster
        # kernels: matmuls of up to fast_linear_rows rows (4; 64 for bf16 on AMX) and sequences with up
        # to FAST_ROWS queries in the step (one-row decode, a k <= 3 verify), torch's for everything bigger.
        self._max_rows = None if batch_invariant else FAST_ROWS
        self._linear_rows = self._max_rows
        self.kernels = "torch"
        if cpu_kernels and self.device.type == "cpu":
            rows = fast_linear_rows(self.model.dtype)  # read either way: a bad HEADSTART_FAST_ROWS is named at once
            self._linear_rows = None if batch_invariant else rows
            got = self.model.enable_cpu_kernels(True, self._linear_rows)
            self.kernels = "rowwise" if "rows" in got else "gemv" if "gemv" in got else "torch"
        cfg = self.model.config
        self.max_model_len = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
        kv_spec = KVCacheSpec.of(self.model)
        draft = None
        if spec is not None and spec.method != "ngram":
            draft = resolve_draft(spec, self.model, dtype, self.device)
        if spec is not None and spec.method == "block":  # the lookahead is the head's block: keep the head, not a path
            spec = dataclasses.replace(spec, head=draft)
        self.spec = spec
        if spec is not None and spec.lookahead >= self.max_model_len:
            what = {"tree": "tree_tokens / tree_topk x depth", "block": "the dflash block_size"}.get(spec.method, "k")
            raise ValueError(f"speculation would reserve {spec.lookahead} KV slots per step ({what}), more than the "
                             f"model's context of {self.max_model_len}: it could never run; lower {what}")
        draft_spec = draft_kv_spec(draft) if draft is not None else None
        specs = [kv_spec] + ([draft_spec] if draft_spec is not None else [])
        if num_pages is None:
            if kv_cache_gb is None:  # enough for max_batch_size full contexts, capped at 1 GiB
                need = max_batch_size * -(-self.max_model_len // page_size)
                num_pages = min(need, pages_for_budget(1.0, specs, page_size))
            else:
                num_pages = pages_for_budget(kv_cache_gb, specs, page_size)
        self.allocator = PageAllocator(num_pages, page_size, prefix_cache)
        self.cache = KVCache(kv_spec, num_pages, page_size, self.device)
        self.backend = make_backend(backend, self.device, cpu_kernels, self._max_rows, model=self.model)
        self.runner = ModelRunner(self.model, self.cache, self.allocator, self.backend, self.device)
        self.proposer = None
        if draft is not None and cpu_kernels and self.device.type == "cpu":
            enable_cpu_kernels(draft, True, self._linear_rows)
        if spec is not None:
            if spec.method == "medusa":
                self.proposer = MedusaProposer(spec, draft)
            elif spec.method == "ngram":
                self.proposer = NgramProposer(spec)
            else:
                draft_runner = ModelRunner(draft, KVCache(draft_spec, num_pages, page_size, self.device),
                                           self.allocator, self.backend, self.device)
                kind = {"chain": HeadChainProposer, "tree": TreeProposer, "draft": DraftModelProposer,
                        "block": BlockProposer}[spec.method]
                self.proposer = kind(spec, draft_runner)
        self.spec_metrics = SpecMetrics(positions=spec.k if spec is not None and spec.method == "tree" else None)
        # speculation in a batch-invariant engine: decoding sequences wait while others prefill (Scheduler.schedule),
        # so a sequence's acceptance does not depend on what shares its steps; --no-batch-invariant keeps the speed
        self.scheduler = Scheduler(self.allocator, max_batch_size, max_batched_tokens, self.device,
                                   hold_decodes=spec is not None and batch_invariant)
        self.stop_ids = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.stop_ids.add(tokenizer.eos_token_id)
        self.seed = seed
        self._ids = itertools.count()
        self._unseeded = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.speculation = SpeculativeStep(self) if spec is not None else None

    # ------------------------------------------------------------------------------ requests

    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Token ids for a prompt: ids as given, a string (chat template applied unless chat=False),
        or OpenAI-style messages."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids")
        if isinstance(prompt, str) and not chat:
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    chat: bool = True) -> str:
        params = params or SamplingParams()
        ids = self.encode(prompt, chat)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        if not ids:
            raise ValueError(f"request {rid}: the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"request {rid}: token id out of range [0, {vocab})")
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(
                f"request {rid}: the prompt has {len(ids)} tokens; the model's context is {self.max_model_len}"
            )
        max_len = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.allocator.pages_for(max_len) > self.allocator.num_pages:
            raise ValueError(
                f"request {rid}: {max_len} tokens need {self.allocator.pages_for(max_len)} KV pages, the cache "
                f"has {self.allocator.num_pages}; raise --kv-cache-gb or lower max_tokens"
            )
        gen = None
        # An unseeded request draws a fresh seed from the engine's seed and a request counter, so two
        # calls (or two requests with the same prompt) never repeat each other's samples.
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + next(self._unseeded)
        if not params.greedy:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
        seq = Sequence(rid, ids, params, gen, seed)
        seq.detok = IncrementalText(self.tokenizer) if self.tokenizer is not None else None
        seq.spec_metrics.positions = self.spec_metrics.positions
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a request; everything held for it (pages, draft state, the sequence) is released."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._final_text(seq, seq.output_ids)
        self._release(request_id)
        return True

    def _release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)  # its draft state (seq.draft) goes with it

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------------------------- steps

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an output for every sequence that produced a token. A
        finished request's last output is its result: the engine keeps nothing of it afterwards."""
        outputs = self._step()
        for out in outputs:
            if out.finished:
                self._release(out.id)
        return outputs

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.speculation is not None:
            seqs = self.speculation.ready()
            if seqs:
                outputs = self.speculation.step(seqs)
                self.stats.steps += 1
                self.stats.preemptions = self.scheduler.num_preemptions
                self.stats.seconds += time.perf_counter() - t0
                return outputs
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.waiting:
                raise RuntimeError("the scheduler cannot admit any request: the KV cache is too small")
            return []
        capture = self.proposer.capture() if self.proposer is not None else ()
        h, aux, _ = self.runner.run(batch.input_ids, batch.items, capture=capture)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_cached += n
            if self.allocator.uncommitted(seq.id, seq.num_cached):  # full pages now computed: reusable
                self.allocator.commit(seq.id, seq.token_ids, seq.num_cached)
        outputs = []
        if batch.samplers:
            logits = self.runner.logits(h, batch.sample_rows)  # (S, V) fp32
            params = [s.params for s in batch.samplers]
            histories = [s.token_ids for s in batch.samplers] if any(
                p.repetition_penalty != 1.0 for p in params) else None
            tokens = sample(logits, params, [s.generator for s in batch.samplers], histories).tolist()
            want_lp = [s for s in batch.samplers if s.params.logprobs is not None]
            lps = token_logprobs(logits, torch.tensor(tokens), max(s.params.logprobs for s in want_lp)) \
                if want_lp else None
            for i, (seq, tok) in enumerate(zip(batch.samplers, tokens)):
                seq.output_ids.append(tok)
                if lps is not None and seq.params.logprobs is not None:
                    entry = lps[i]
                    if "top" in entry:
                        entry = {**entry, "top": entry["top"][: seq.params.logprobs]}
                    seq.logprobs.append(entry)
                self._check_stop(seq, tok)
                outputs.append(self._output(seq, [tok]))
        if self.speculation is not None:
            t1 = time.perf_counter()
            self.speculation.absorb_normal(batch, h, aux)
            self.spec_metrics.draft_seconds += time.perf_counter() - t1
        self.stats.steps += 1
        self.stats.prefill_tokens += sum(n for n in batch.num_tokens if n > 1)
        self.stats.decode_tokens += len(batch.samplers)
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_tokens = self.scheduler.cached_tokens
        self.stats.seconds += time.perf_counter() - t0
        return outputs

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        if (tok in self.stop_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            self._final_text(seq, seq.output_ids[:-1])
            self.scheduler.finish(seq, "stop")
            return
        if seq.detok is not None:
            stopped = seq.detok.add(seq.output_ids, p.stop)
            seq.text = seq.detok.text
            if stopped:
                self.scheduler.finish(seq, "stop")
                return
        if len(seq.output_ids) >= p.max_tokens or seq.total_len >= self.max_model_len:
            self._final_text(seq, seq.output_ids)
            self.scheduler.finish(seq, "length")

    def _final_text(self, seq: Sequence, ids: list[int]) -> None:
        if seq.detok is not None:
            seq.text = seq.detok.final(ids)

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        metrics = seq.spec_metrics.summary() if self.proposer is not None else None
        return RequestOutput(seq.id, seq.prompt_ids, list(seq.output_ids), seq.text,
                             seq.status is Status.FINISHED, seq.finish_reason, new, list(seq.logprobs), metrics)

    # ------------------------------------------------------------------------------- generate

    def generate(
        self, prompts: Iterable[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
        *, chat: bool = True, on_output: Callable[[RequestOutput], None] | None = None,
        request_ids: list[str] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs in prompt order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(p, sp, request_ids[i] if request_ids else None, chat)
               for i, (p, sp) in enumerate(zip(prompts, plist))]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.id] = dataclasses.replace(out, new_token_ids=[])
                if on_output is not None:
                    on_output(out)
        return [final[i] for i in ids]
