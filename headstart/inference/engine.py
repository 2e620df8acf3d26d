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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from headstart.inference.backends import make_backend
from headstart.inference.detok import IncrementalText
from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator, pages_for_budget
from headstart.inference.rejection import Verdict, verify_chain, verify_greedy, verify_tree
from headstart.inference.runner import ModelRunner
from headstart.inference.sampler import SamplingParams, processed_probs, rows_logprobs, sample, token_logprobs
from headstart.inference.scheduler import ScheduledBatch, Scheduler, Sequence, Status
from headstart.inference.spec import (
    DraftModelProposer,
    HeadChainProposer,
    MedusaProposer,
    SpecConfig,
    SpecMetrics,
    draft_kv_spec,
)
from headstart.inference.tree import TreeProposer
from headstart.kernels import MAX_ROWS
from headstart.models.llama import LlamaForCausalLM, load_llama
from headstart.nn.linear import enable_cpu_kernels

Prompt = str | list[dict[str, str]] | list[int]


@dataclass
class RequestOutput:
    id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)  # produced by the last step
    logprobs: list[dict] = field(default_factory=list)
    spec_metrics: dict[str, Any] | None = None  # acceptance metrics of this request (speculation on)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    seconds: float = 0.0


class Engine:
    def __init__(
        self,
        model: str | Path | LlamaForCausalLM,
        *,
        tokenizer: Any | None = None,
        dtype: str = "bf16",
        device: str | torch.device = "cpu",
        backend: str = "auto",
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_gb: float | None = None,
        max_batch_size: int = 32,
        max_batched_tokens: int = 2048,
        seed: int = 0,
        cpu_kernels: bool = True,
        batch_invariant: bool = True,
        spec: SpecConfig | None = None,
    ) -> None:
        for name, value in (("page_size", page_size), ("max_batch_size", max_batch_size),
                            ("max_batched_tokens", max_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if num_pages is not None and num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.device = torch.device(device)
        if isinstance(model, LlamaForCausalLM):
            self.model = model
            if tokenizer is None and model.source_dir is not None and (model.source_dir / "tokenizer.json").exists():
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(model.source_dir))
        else:
            from headstart.assets import resolve_model

            model_dir = resolve_model(model)
            self.model = load_llama(model_dir, dtype=dtype, device=self.device)
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer = tokenizer
        # CPU: the row-invariant kernels (headstart.kernels) for every matmul and attention row when
        # batch_invariant (a token's logits never depend on what shares its step or where its prompt
        # was chunked: greedy speculation equals greedy AR), else for matmuls of up to MAX_ROWS rows
        # and sequences with up to MAX_ROWS queries in the step (decode, verify), torch's for prefill.
        self._max_rows = None if batch_invariant else MAX_ROWS
        self.kernels = "torch"
        if cpu_kernels and self.device.type == "cpu":
            got = self.model.enable_cpu_kernels(True, self._max_rows)
            self.kernels = "rowwise" if "rows" in got else "gemv" if "gemv" in got else "torch"
        cfg = self.model.config
        self.max_model_len = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
        kv_spec = KVCacheSpec(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                              head_dim=cfg.head_dim, dtype=self.model.dtype)
        self.spec = spec
        if spec is not None and spec.lookahead >= self.max_model_len:
            what = "tree_tokens / tree_topk x depth" if spec.method == "tree" else "k"
            raise ValueError(f"speculation would reserve {spec.lookahead} KV slots per step ({what}), more than the "
                             f"model's context of {self.max_model_len}: it could never run; lower {what}")
        draft = self._resolve_draft(spec, dtype) if spec is not None else None
        draft_spec = draft_kv_spec(draft) if draft is not None else None
        specs = [kv_spec] + ([draft_spec] if draft_spec is not None else [])
        if num_pages is None:
            if kv_cache_gb is None:  # enough for max_batch_size full contexts, capped at 1 GiB
                need = max_batch_size * -(-self.max_model_len // page_size)
                num_pages = min(need, pages_for_budget(1.0, specs, page_size))
            else:
                num_pages = pages_for_budget(kv_cache_gb, specs, page_size)
        self.allocator = PageAllocator(num_pages, page_size)
        self.cache = KVCache(kv_spec, num_pages, page_size, self.device)
        self.backend = make_backend(backend, self.device, cpu_kernels, self._max_rows)
        self.runner = ModelRunner(self.model, self.cache, self.allocator, self.backend, self.device)
        self.proposer = None
        if draft is not None and cpu_kernels and self.device.type == "cpu":
            enable_cpu_kernels(draft, True, self._max_rows)
        if spec is not None:
            if spec.method == "medusa":
                self.proposer = MedusaProposer(spec, draft)
            else:
                draft_runner = ModelRunner(draft, KVCache(draft_spec, num_pages, page_size, self.device),
                                           self.allocator, self.backend, self.device)
                kind = {"chain": HeadChainProposer, "tree": TreeProposer, "draft": DraftModelProposer}[spec.method]
                self.proposer = kind(spec, draft_runner)
        self.spec_metrics = SpecMetrics(positions=spec.k if spec is not None and spec.method == "tree" else None)
        self.scheduler = Scheduler(self.allocator, max_batch_size, max_batched_tokens, self.device)
        self.stop_ids = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.stop_ids.add(tokenizer.eos_token_id)
        self.seed = seed
        self._ids = itertools.count()
        self._unseeded = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()

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
        if self.proposer is not None:
            seqs = self._spec_ready()
            if seqs:
                outputs = self._spec_step(seqs)
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
        if self.proposer is not None:
            t1 = time.perf_counter()
            self._absorb_normal(batch, h, aux)
            self.spec_metrics.draft_seconds += time.perf_counter() - t1
        self.stats.steps += 1
        self.stats.prefill_tokens += sum(n for n in batch.num_tokens if n > 1)
        self.stats.decode_tokens += len(batch.samplers)
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.seconds += time.perf_counter() - t0
        return outputs

    # ---------------------------------------------------------------------------- speculation

    def _resolve_draft(self, spec: SpecConfig, dtype: str) -> Any:
        """The proposer's model: a head (chain / medusa) or a draft LM, loaded if given as a path."""
        from headstart.heads import DraftHead, is_head_checkpoint, load_head

        if spec.method in ("chain", "medusa", "tree"):
            head = spec.head
            if head is None:
                raise ValueError(f"--spec {spec.method} needs a head (a checkpoint directory)")
            if not isinstance(head, DraftHead):
                head = load_head(head, self.model, allow_other_target=spec.allow_other_target)
            kinds = ("medusa",) if spec.method == "medusa" else ("mtp", "eagle1", "deepseek_mtp", "eagle3")
            if head.config.head_type not in kinds:
                raise ValueError(f"--spec {spec.method} cannot use a {head.config.head_type!r} head "
                                 f"(it takes {', '.join(kinds)})")
            return head
        draft = spec.draft
        if draft is None:
            raise ValueError("--spec draft needs a draft model (--draft NAME_OR_DIR or a DraftLM head)")
        if isinstance(draft, (str, Path)):
            from headstart.assets import resolve_model
            from headstart.heads import DraftLM

            path = Path(str(draft))
            if is_head_checkpoint(path):
                head = load_head(path, self.model, allow_other_target=spec.allow_other_target)
                if not isinstance(head, DraftLM):
                    raise ValueError(f"{path}: a {head.config.head_type!r} head is not a draft model")
                return head
            draft = load_llama(resolve_model(str(draft)), dtype=dtype, device=self.device)
            if draft.config.vocab_size != self.model.config.vocab_size:
                raise ValueError(f"the draft's vocab_size {draft.config.vocab_size} differs from the target's "
                                 f"{self.model.config.vocab_size}: they must share a tokenizer")
        from headstart.heads import DraftLM

        if not isinstance(draft, DraftLM | LlamaForCausalLM):
            raise TypeError(f"a draft model must be a DraftLM head or a LlamaForCausalLM, got {type(draft).__name__}")
        return draft

    def _spec_ready(self) -> list[Sequence] | None:
        sched, look = self.scheduler, self.spec.lookahead
        if not sched.running or (sched.waiting and len(sched.running) < sched.max_batch_size):
            return None
        for s in sched.running:
            if s.total_len - s.num_cached != 1 or not self.proposer.ready(s):
                return None
            if s.total_len + look > self.max_model_len:
                return None
        return sched.schedule_spec(lookahead=look)

    def _spec_step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        if isinstance(self.proposer, TreeProposer):
            return self._tree_step(seqs)
        k = self.spec.k
        t0 = time.perf_counter()
        proposal = self.proposer.propose(seqs, k)
        t1 = time.perf_counter()
        items = [(s.id, s.num_cached, s.num_cached + k + 1) for s in seqs]
        ids = [t for s, d in zip(seqs, proposal.drafts) for t in [s.token_ids[-1]] + d]
        h, aux, _ = self.runner.run(ids, items, capture=self.proposer.capture())
        logits = self.runner.logits(h)  # (B * (k+1), V)
        params = [s.params for s in seqs for _ in range(k + 1)]
        histories = None
        if any(p.repetition_penalty != 1.0 for p in params):
            histories = [s.token_ids + d[:j] for s, d in zip(seqs, proposal.drafts) for j in range(k + 1)]
        if histories is None and all(s.params.greedy for s in seqs):  # argmaxes only: one host sync
            best = logits.argmax(-1).tolist()
            verdicts = [verify_greedy(d, best[b * (k + 1):(b + 1) * (k + 1)]) for b, d in enumerate(proposal.drafts)]
        else:
            verdicts = self._verify_batch(seqs, proposal, processed_probs(logits, params, histories), k)
        outputs, absorb = [], []
        for b, (seq, verdict) in enumerate(zip(seqs, verdicts)):
            n, a = seq.num_cached, verdict.accepted
            seq.spec_metrics.add(a, k)
            self.spec_metrics.add(a, k)
            rows = list(range(b * (k + 1), b * (k + 1) + a + 1))  # the rows whose logits gave each token
            outputs.append(self._commit(seq, n, a, verdict.tokens, rows_logprobs(seq.params, logits, rows,
                                                                                 verdict.tokens)))
            if seq.status is not Status.FINISHED:
                absorb.append((seq, n, n + a + 1, rows))
        return self._finish_spec_step(outputs, absorb, h, aux, t0, t1)

    def _verify_batch(self, seqs: list[Sequence], proposal: Any, p: torch.Tensor, k: int) -> list[Verdict]:
        """Sampled (or mixed) verification of every sequence at once on the logits' device: k + 1
        uniforms per sampling request from its own generator, the rules as tensor ops, one host sync."""
        b = len(seqs)
        u = torch.stack([torch.rand(k + 1, generator=s.generator, dtype=torch.float64) if not s.params.greedy
                         else torch.zeros(k + 1, dtype=torch.float64) for s in seqs]).to(p.device)
        q = torch.stack(proposal.q).to(p.device) if all(x is not None for x in proposal.q) else None
        drafts = torch.tensor(proposal.drafts, dtype=torch.long, device=p.device)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=p.device)
        a, tokens, ok = verify_chain(drafts, p.view(b, k + 1, -1), q, u, greedy)
        table = torch.cat([a.unsqueeze(1), ok.long().unsqueeze(1), tokens], 1).tolist()  # the one host sync
        out = []
        for seq, (acc, good, *toks) in zip(seqs, table):
            if not good:
                raise ValueError(f"request {seq.id}: cannot sample: the distribution has no positive finite "
                                 "probability (all zero or NaN); check the sampling parameters and the logits")
            out.append(Verdict(acc, toks[:acc + 1]))
        return out

    def _tree_step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """EAGLE-2: draft a tree per sequence, verify every node in one target pass under a tree mask,
        accept a path with the tree rule, then move the path's K/V to contiguous positions."""
        t0 = time.perf_counter()
        trees = self.proposer.propose_trees(seqs)
        t1 = time.perf_counter()
        items, masks, positions, ids = [], [], [], []
        for s, tree in zip(seqs, trees):
            n, m = s.num_cached, len(tree.tokens)
            items.append((s.id, n, n + m))
            masks.append(tree.mask(n))
            positions.append([n + d for d in tree.depths])
            ids.extend(tree.tokens)
        h, aux, _ = self.runner.run(ids, items, capture=self.proposer.capture(), masks=masks, positions=positions)
        logits = self.runner.logits(h)
        params = [s.params for s, t in zip(seqs, trees) for _ in t.tokens]
        histories = None
        if any(p.repetition_penalty != 1.0 for p in params):
            histories = [s.token_ids + [t.tokens[a] for a in t.ancestors(i)] for s, t in zip(seqs, trees)
                         for i in range(len(t.tokens))]
        p = processed_probs(logits, params, histories)
        outputs, absorb, row = [], [], 0
        for seq, tree in zip(seqs, trees):
            n, m = seq.num_cached, len(tree.tokens)
            path, emitted = verify_tree(tree.children, tree.tokens, p[row:row + m], seq.params.greedy, seq.generator)
            a = len(path)
            seq.spec_metrics.add(a, m - 1)
            self.spec_metrics.add(a, m - 1)
            # Compaction: node j of the path moves from KV index n + node to n + j + 1.
            self.runner.move_kv(seq.id, [n + node for node in path], list(range(n + 1, n + a + 1)))
            rows = [row] + [row + node for node in path]
            outputs.append(self._commit(seq, n, a, emitted, rows_logprobs(seq.params, logits, rows, emitted)))
            if seq.status is not Status.FINISHED:
                absorb.append((seq, n, n + a + 1, rows))
            row += m
        return self._finish_spec_step(outputs, absorb, h, aux, t0, t1)

    def _finish_spec_step(self, outputs: list[RequestOutput], absorb: list, h: torch.Tensor,
                          aux: dict[int, torch.Tensor], t0: float, t1: float) -> list[RequestOutput]:
        """Re-run the draft over the accepted spans and book the step's draft / verify time."""
        t2 = time.perf_counter()
        if absorb:
            self.proposer.absorb(absorb, h, aux)
        t3 = time.perf_counter()
        self.spec_metrics.draft_seconds += (t1 - t0) + (t3 - t2)
        self.spec_metrics.verify_seconds += t2 - t1
        self.stats.decode_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def _commit(self, seq: Sequence, n: int, a: int, tokens: list[int],
                logprobs: list[dict] | None = None) -> RequestOutput:
        """After verification: keep the pending token and the a accepted drafts in the caches, drop
        the rest, emit the tokens (up to a stop condition) with their log-probabilities if asked."""
        seq.num_cached = n + 1 + a
        self.scheduler.truncate(seq)
        self.proposer.after_verify(seq, n, a)
        new = []
        for i, tok in enumerate(tokens):
            seq.output_ids.append(tok)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            new.append(tok)
            self._check_stop(seq, tok)
            if seq.status is Status.FINISHED:
                self.proposer.forget(seq)
                break
        return self._output(seq, new)

    def _absorb_normal(self, batch: ScheduledBatch, h: torch.Tensor, aux: dict[int, torch.Tensor]) -> None:
        """After a normal step: bring the draft's cache up to the target's for every live sequence."""
        items, row = [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_cached - n
            if seq.status is Status.FINISHED or start == 0:
                # Finished, or (re)prefilled from scratch after a preemption released its pages.
                self.proposer.forget(seq)
            if seq.status is not Status.FINISHED:
                items.append((seq, start, seq.num_cached, list(range(row, row + n))))
            row += n
        if items:
            self.proposer.absorb(items, h, aux)

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
