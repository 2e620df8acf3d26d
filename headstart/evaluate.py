"""`headstart eval`: the engine with and without speculation on the same prompts, per head x method x
k x temperature, beside a no-training baseline (prompt lookup); writes report.json, report.md and
PNG plots.

Speed survives a shared machine: each setting's runs alternate with plain decoding of the same
prompts, batch group by batch group (AR, spec; then spec, AR on the next repeat), so a change of load
hits both sides of a ratio. `speedup` is the median of the per-group ratios (speculative tokens/s
over AR tokens/s, wall-clock with prefill, after a warm-up run) with their spread; a wide spread is
flagged. At temperature 0 the report says whether speculative output equals AR output token for
token (`lossless_check`).
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from headstart.errors import ConfigError, DataError, HeadstartError
from headstart.eval_report import FORMAT, WIDE_SPREAD, head_labels
from headstart.eval_report import quantile as _quantile
from headstart.sizing import EVAL_BATCH, KV_PAGE_TOKENS

ROLES = ("system", "user", "assistant")
MAX_K = 32  # draft length / tree depth: acceptance past a few tokens is ~0, and each step reserves k KV slots


@dataclass
class EvalPlan:
    heads: list[str]
    ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    methods: list[str] = field(default_factory=lambda: ["chain"])
    batch_size: int = EVAL_BATCH  # what plan's eval term sizes
    max_tokens: int = 64
    seed: int = 0
    tree_topk: int = 4
    tree_tokens: int = 16
    allow_other_target: bool = False  # heads trained for a same-shaped target with other weights
    baseline: bool = True  # add prompt-lookup (ngram) rows: what speculation gives without training
    repeats: int = 1  # alternations of AR and speculative runs per batch group (timing only)
    draft_threshold: float = 0.4  # the "adaptive" method: a chain that stops when the head is unsure
    backend: str = "auto"  # engine.backend: the attention backend (inference.backends.choose_backend)
    engines: list[str] = field(default_factory=lambda: ["headstart"])  # headstart and/or vllm (engines/)
    vllm_threads: str = "all"  # vLLM's CPU threads: all cores, as ours, or "default" (its own binding)
    workdir: str | None = None  # where vLLM's exports, jobs and logs go (the report directory)


def read_prompt_file(path: str | Path) -> list[dict[str, Any]]:
    """JSONL rows with "prompt" (text) or "messages" (chat turns: role + content strings), optional
    "category" (a string). Errors name the file and line."""
    rows = []
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such prompts file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text") from None
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i}: not JSON ({e.msg})") from None
        where = f"{path}:{i}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be a JSON object")
        if "messages" in row:
            msgs = row["messages"]
            if not (isinstance(msgs, list) and msgs and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs)):
                raise DataError(f"{where}: \"messages\" must be a non-empty list of "
                                "{\"role\": str, \"content\": str}")
            bad = [m["role"] for m in msgs if m["role"] not in ROLES]
            if bad:
                raise DataError(f"{where}: role {bad[0][:40]!r} is not one of {', '.join(ROLES)}")
        elif not (isinstance(row.get("prompt"), str) and row["prompt"].strip()):
            raise DataError(f"{where}: a row needs a non-empty \"prompt\" string or a \"messages\" list")
        if row.get("category") is not None and not isinstance(row["category"], str):
            raise DataError(f"{where}: \"category\" must be a string, got {type(row['category']).__name__}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no prompts")
    return rows


def _engine(target: Any, tokenizer: Any, prompts: list[list[int]], plan: EvalPlan, spec: Any) -> Any:
    from headstart.inference import Engine
    from headstart.inference.scheduler import kv_pages_for, one_step_prefill_budget

    page = KV_PAGE_TOKENS
    # the engine stops a request at the context length
    pages = kv_pages_for(prompts, plan.max_tokens, plan.batch_size, spec.lookahead if spec else 0, page,
                         target.config.max_position_embeddings)
    budget = one_step_prefill_budget(prompts, plan.batch_size)  # each batch group prefills in one step
    return Engine(target, tokenizer=tokenizer, device=target.model.embed_tokens.weight.device, page_size=page,
                  num_pages=pages, max_batch_size=plan.batch_size, max_batched_tokens=budget, seed=plan.seed,
                  spec=spec, backend=plan.backend)


def _warm(engine: Any) -> None:
    from headstart.inference import SamplingParams

    engine.generate([[engine.model.config.bos_token_id or 1] * 4], SamplingParams(max_tokens=4, temperature=0.0))


def _run(engine: Any, prompts: list[list[int]], first: int, temperature: float, plan: EvalPlan) -> tuple[list, float]:
    """Decode `prompts` (indices first.. of the whole set, which fix their seeds) -> (outputs, seconds)."""
    from headstart.inference import SamplingParams

    params = [SamplingParams(max_tokens=plan.max_tokens, temperature=temperature, seed=plan.seed + first + i,
                             ignore_eos=False) for i in range(len(prompts))]
    t0 = time.perf_counter()
    with torch.inference_mode():
        outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0


@dataclass
class _Setting:
    label: str
    path: str | None  # None: the baseline proposer (no head)
    head: Any
    method: str  # chain | tree | adaptive | medusa | draft | ngram
    k: int

    def spec(self, plan: EvalPlan) -> Any:
        from headstart.inference.speculation import SpecConfig

        if self.method == "ngram":
            return SpecConfig(method="ngram", k=self.k)
        method = "chain" if self.method == "adaptive" else self.method
        return SpecConfig(method=method, k=self.k, head=self.head if method != "draft" else None,
                          draft=self.head if method == "draft" else None, tree_topk=plan.tree_topk,
                          tree_tokens=plan.tree_tokens,
                          draft_threshold=plan.draft_threshold if self.method == "adaptive" else None)


def _settings(heads: dict[str, Any], labels: dict[str, str], plan: EvalPlan) -> list[_Setting]:
    from headstart.inference.speculation import spec_method

    out = []
    for path, head in heads.items():
        for method in _methods(head, plan):
            for k in plan.ks:
                if spec_method(head.config.head_type) == "medusa" and k > head.config.medusa_num_heads:
                    continue
                if spec_method(head.config.head_type) == "block" and k > head.config.block_size - 1:
                    continue
                out.append(_Setting(labels[path], path, head, method, k))
    if plan.baseline:
        out += [_Setting("ngram (no training)", None, None, "ngram", k) for k in plan.ks]
    return out


def _timed_setting(ar_engine: Any, engine: Any, prompts: list[list[int]], temp: float, plan: EvalPlan,
                   tick: Any) -> dict[str, Any]:
    """Alternate AR and speculative runs over each batch group, `plan.repeats` times (order flipped
    on odd repeats) -> outputs of the first repeat and the per-group tokens/s ratios."""
    b = plan.batch_size
    outs, ar_outs, ratios = [], [], []
    ar_tok = ar_sec = sp_tok = sp_sec = 0.0
    from headstart.inference.speculation import SpecMetrics

    m = getattr(engine, "spec_metrics", None) or SpecMetrics()  # a stand-in engine may keep none
    d0, v0, n0 = m.draft_seconds, m.verify_seconds, m.steps
    for first in range(0, len(prompts), b):
        group = prompts[first:first + b]
        for rep in range(plan.repeats):
            order = ("ar", "spec") if rep % 2 == 0 else ("spec", "ar")
            got = {}
            for which in order:
                got[which] = _run(ar_engine if which == "ar" else engine, group, first, temp, plan)
                tick(len(group) / 2)
            (a_out, a_sec), (s_out, s_sec) = got["ar"], got["spec"]
            a_n, s_n = sum(len(o.token_ids) for o in a_out), sum(len(o.token_ids) for o in s_out)
            ratios.append((s_n / s_sec) / (a_n / a_sec))
            ar_tok, ar_sec, sp_tok, sp_sec = ar_tok + a_n, ar_sec + a_sec, sp_tok + s_n, sp_sec + s_sec
            if rep == 0:
                outs += s_out
                ar_outs += a_out
    steps = max(m.steps - n0, 1)  # the draft (propose + absorb) and verify time of a speculative step
    return {"outputs": outs, "ar_outputs": ar_outs, "ratios": ratios, "batch": b, "tokens": sp_tok, "seconds": sp_sec,
            "ar_tokens_per_s": ar_tok / ar_sec, "draft_ms_per_step": 1e3 * (m.draft_seconds - d0) / steps,
            "verify_ms_per_step": 1e3 * (m.verify_seconds - v0) / steps}


def evaluate(target: Any, tokenizer: Any, prompts: list[list[int]], categories: list[str | None], plan: EvalPlan,
             *, progress: bool = True, info: dict[str, Any] | None = None) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from headstart.console import status
    from headstart.heads import load_head

    if not prompts:
        raise DataError("eval: no prompts")
    context = target.config.max_position_embeddings
    check_plan(plan, context)
    for i, p in enumerate(prompts):
        if len(p) + 1 > context:  # checked before any KV page is allocated
            raise DataError(f"eval: prompt {i} has {len(p):,} tokens; the target's context is {context:,}")
    heads = {path: load_head(path, target, allow_other_target=plan.allow_other_target) for path in plan.heads}
    labels = head_labels(plan.heads)
    settings = _settings(heads, labels, plan) if "headstart" in plan.engines else []
    if not settings and plan.engines == ["headstart"]:
        raise ConfigError(f"eval: nothing to run: every --k ({plan.ks}) exceeds the Medusa heads' count and "
                          "--no-baseline is set")
    runs, ar, kernels, attention = [], {}, None, None
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, console=Console(stderr=True)) as bar:  # stdout is the verb's report
        task = bar.add_task("eval", total=len(plan.temperatures) * len(settings) * plan.repeats * len(prompts))
        for temp in plan.temperatures if settings else []:  # --engine vllm alone: none of ours
            ar_engine = _engine(target, tokenizer, prompts, plan, None)
            kernels, attention = ar_engine.kernels, ar_engine.backend.name
            _warm(ar_engine)
            rates = []
            for st in settings:
                name = f"{st.label} {st.method} k={st.k} T={temp}"
                try:
                    engine = _engine(target, tokenizer, prompts, plan, st.spec(plan))
                except ValueError as e:  # a plan this target can never run
                    raise HeadstartError(f"eval: {name}: {e}") from None
                _warm(engine)
                bar.update(task, description=name)
                timed = _timed_setting(ar_engine, engine, prompts, temp, plan,
                                       lambda n: bar.update(task, advance=n))
                rates.append(timed["ar_tokens_per_s"])
                if temp not in ar:
                    ar[temp] = {"outputs": [o.token_ids for o in timed["ar_outputs"]]}
                row = _summarise(st, temp, timed, categories, ar[temp])
                if st.method == "adaptive":
                    row["draft_threshold"] = plan.draft_threshold
                runs.append(row)
                if row["speedup_spread"] > WIDE_SPREAD:
                    status(f"eval: warning: {name}: the per-group speedups spread widely (middle half "
                           f"{row['speedup_p25']:.2f}x..{row['speedup_p75']:.2f}x, all {row['speedup_min']:.2f}x.."
                           f"{row['speedup_max']:.2f}x, median {row['speedup']:.2f}x): the groups' text differs, or "
                           "the machine's load changed; more prompts per group or --repeats 3 on a quiet machine "
                           "tell them apart")
            ar[temp]["tokens_per_s"] = sorted(rates)[len(rates) // 2] if rates else None
    extra = {}
    if "vllm" in plan.engines:
        extra = _vllm(target, tokenizer, prompts, categories, plan, heads, labels, runs)
    return {
        **extra,
        "format": FORMAT,
        "runs": runs,
        "heads": {path: {"head_type": h.config.head_type, "num_layers": h.config.num_layers,
                         "aux_layer_ids": h.config.aux_layer_ids, "draft_vocab_size": h.config.draft_vocab_size,
                         "weights_sha256": _sha(path)} for path, h in heads.items()},
        "engine": {"page_size": 16, "max_batch_size": plan.batch_size, "backend": attention,
                   # what the engine really ran: without the row-invariant kernels (HEADSTART_KERNELS=0, no
                   # compiler, CUDA) a token's bits depend on its batch, and lossless_check may differ
                   "kernels": kernels, "batch_invariant": kernels == "rowwise", "linear_isa": _linear_isa(kernels),
                   "tree_topk": plan.tree_topk, "tree_tokens": plan.tree_tokens,
                   "draft_threshold": plan.draft_threshold, "repeats": plan.repeats},
        "ar": {str(t): {k: v for k, v in r.items() if k != "outputs"} for t, r in ar.items()},
        "prompts": len(prompts), "max_tokens": plan.max_tokens, "batch_size": plan.batch_size, "seed": plan.seed,
        "settings": {**(info or {}), "torch": torch.__version__, "python": platform.python_version(),
                     "machine": platform.machine(), "cpu_bf16": _cpu_flag(), "threads": torch.get_num_threads()},
    }


def _vllm(target: Any, tokenizer: Any, prompts: list[list[int]], categories: list[str | None], plan: EvalPlan,
          heads: dict[str, Any], labels: dict[str, str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's rows beside ours (engines/vllm_eval.py); adds them to `runs` -> the report's vLLM keys."""
    import tempfile

    from headstart.console import status
    from headstart.engines.vllm_eval import compare_engines, vllm_eval
    from headstart.engines.vllm_runner import Threads

    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[target.lm_head.weight.dtype]
    stop = sorted(set(target.config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer is not None and
                                                       tokenizer.eos_token_id is not None else set()))
    workdir = Path(plan.workdir) / "vllm" if plan.workdir else Path(tempfile.mkdtemp(prefix="headstart-vllm-"))
    status(f"eval: vLLM runs the same {len(prompts)} prompts ({dtype}; exports, jobs and its log in {workdir})")
    got = vllm_eval(target, prompts, categories, plan, heads, labels, dtype, workdir, stop,
                    threads=Threads(plan.vllm_threads))
    for s in got["skipped"]:
        status(f"eval: vLLM: {s['label']}: skipped: {s['reason']}")
    runs += got["runs"]
    compare_engines(runs)
    return {"vllm": {**got["vllm"], "skipped": got["skipped"],
                     "ar": {t: {k: v for k, v in r.items() if k != "outputs"} for t, r in got["ar"].items()}}}


def _sha(path: str) -> str | None:
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("weights_sha256")
    except (OSError, ValueError):
        return None


def _methods(head: Any, plan: EvalPlan) -> list[str]:
    from headstart.inference.speculation import spec_method

    kind = spec_method(head.config.head_type)
    if kind == "chain":
        return [m for m in plan.methods if m in ("chain", "tree", "adaptive")] or ["chain"]
    return [kind]


def _linear_isa(kernels: str | None) -> str | None:
    """The instructions the row kernels' bf16 linear ran on (amx-bf16, avx512-bf16, ...), if they ran."""
    if kernels != "rowwise":
        return None
    from headstart.kernels import rowwise

    mod = rowwise()
    return mod.linear_isa() if mod is not None else None


def _cpu_flag() -> bool:
    from headstart.hardware import cpu_has_native_bf16

    return cpu_has_native_bf16()


def _summarise(st: _Setting, temp: float, timed: dict[str, Any], categories: list[str | None],
               ar: dict[str, Any]) -> dict[str, Any]:
    from headstart.inference.speculation import SpecMetrics

    k, outs = st.k, timed["outputs"]
    pooled = SpecMetrics(positions=k)  # tree: k is the depth, the longest acceptable run
    per_cat: dict[str, list[int]] = {}
    for o, cat in zip(outs, categories):
        hist = (o.spec_metrics or {}).get("accept_histogram") or []
        for a, count in enumerate(hist):
            for _ in range(count):
                pooled.add(a, k)
        if cat is not None and sum(hist):
            c = per_cat.setdefault(cat, [0, 0])
            c[0] += sum(a * count for a, count in enumerate(hist))
            c[1] += sum(hist)
    s = pooled.summary()
    if st.method in ("tree", "adaptive", "ngram"):
        # accepted / drafted is not comparable with a fixed-length chain's alpha (trees verify many nodes,
        # adaptive and n-gram steps draft fewer than k): not reported
        s["alpha"] = None
    ratios = sorted(timed["ratios"])
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    b = max(1, timed.get("batch") or len(outs))  # the batch groups the speed pairs were timed on
    row = {"engine": "headstart", "head": st.path, "label": st.label,
           "head_type": st.head.config.head_type if st.head else None,
           "method": st.method, "k": k, "temperature": temp,
           "tau": s["tau"], "alpha": s["alpha"], "accept_rate_per_pos": s["accept_rate_per_pos"],
           "cond_accept_per_pos": s["cond_accept_per_pos"], "accept_histogram": s["accept_histogram"],
           "steps": s["steps"], "tokens": timed["tokens"], "seconds": timed["seconds"],
           "tokens_per_s": timed["tokens"] / timed["seconds"], "ar_tokens_per_s": timed["ar_tokens_per_s"],
           "speedup": median, "speedup_min": ratios[0], "speedup_max": ratios[-1],
           "speedup_p25": _quantile(ratios, 0.25), "speedup_p75": _quantile(ratios, 0.75),
           # the middle half's width relative to the median: robust to one odd group
           "speedup_spread": (_quantile(ratios, 0.75) - _quantile(ratios, 0.25)) / median,
           "timing_pairs": len(ratios), "draft_ms_per_step": timed.get("draft_ms_per_step"),
           "verify_ms_per_step": timed.get("verify_ms_per_step"),
           "tau_by_category": {c: 1 + a / n for c, (a, n) in sorted(per_cat.items())},
           "tau_by_group": [_tau(outs[i:i + b]) for i in range(0, len(outs), b)]}
    if temp == 0:
        same = sum(o.token_ids == ref for o, ref in zip(outs, ar["outputs"]))
        row["lossless_check"] = "identical" if same == len(outs) else f"differs in {len(outs) - same} of {len(outs)}"
    return row


def _tau(outs: list[Any]) -> float | None:
    """tau over some outputs' accepted-length histograms (None: no speculative step)."""
    hist = [0] * 64
    for o in outs:
        for a, c in enumerate((o.spec_metrics or {}).get("accept_histogram") or []):
            hist[a] += c
    n = sum(hist)
    return 1 + sum(a * c for a, c in enumerate(hist)) / n if n else None


def check_plan(plan: EvalPlan, context: int | None = None) -> None:
    """Refuse a plan that could never run; with the target's `context`, lengths past it too."""
    if not plan.heads:
        raise HeadstartError("eval: give at least one --head")
    plan.engines = list(dict.fromkeys(plan.engines))
    bad = [e for e in plan.engines if e not in ("headstart", "vllm")] or (not plan.engines and ["(none)"])
    if bad:
        raise ConfigError(f"eval: --engine takes headstart and/or vllm, got {str(bad[0])[:40]!r}")
    if plan.vllm_threads not in ("all", "default"):
        raise ConfigError(f"eval: --vllm-threads takes all or default, got {plan.vllm_threads[:40]!r}")
    if any(not 1 <= k <= MAX_K for k in plan.ks) or not plan.ks:
        raise ConfigError(f"eval: --k must list integers in 1..{MAX_K}, got {str(plan.ks)[:60]}")
    if any(not (math.isfinite(t) and t >= 0) for t in plan.temperatures) or not plan.temperatures:
        raise ConfigError(f"eval: --temperature must list finite values >= 0, got {str(plan.temperatures)[:60]}")
    bad = [m for m in plan.methods if m not in ("chain", "tree", "adaptive")]
    if bad:
        raise HeadstartError(f"eval: --spec takes chain, tree and/or adaptive, got {str(bad)[:60]}")
    if not (1 <= plan.tree_tokens <= 256 and 1 <= plan.tree_topk <= MAX_K):
        raise ConfigError(f"eval: --tree-tokens must be in 1..256 and --tree-topk in 1..{MAX_K}, got "
                          f"{plan.tree_tokens} and {plan.tree_topk}")
    if not 1 <= plan.repeats <= 20:
        raise ConfigError(f"eval: --repeats must be in 1..20, got {plan.repeats}")
    if not (math.isfinite(plan.draft_threshold) and 0 < plan.draft_threshold < 1):
        raise ConfigError(f"eval: --draft-threshold must be in (0, 1), got {plan.draft_threshold}")
    if plan.batch_size < 1 or plan.max_tokens < 1:
        raise HeadstartError("eval: --batch-size and --max-tokens must be >= 1")
    if context is not None and plan.max_tokens >= context:
        raise ConfigError(f"eval: --max-tokens {plan.max_tokens:,} is not below the target's context of "
                          f"{context:,} tokens (max_position_embeddings); lower --max-tokens")
