"""`headstart eval --engine vllm`: the same prompts, heads, k, temperatures and batch size run by vLLM,
summarised under the names our engine's rows use, so the two sit side by side in one report.

- Acceptance comes from vLLM's own counters (drafts, accepted per position), differenced around
  each run; tau and the per-position rates follow DESIGN §1.
- Speed alternates plain and speculative vLLM runs over each batch group (AR, spec; then spec, AR
  on the next repeat), as our eval does; `speedup` is the median of the per-group ratios.
- Lossless: greedy speculative text equals vLLM's plain text, checked in fp32. vLLM's bf16 kernels
  are not batch-invariant (a 4-row verify pass and a 1-row decode round a near-tie differently), so
  in bf16 the two part mid-answer on some prompts without any fault of the head; that agreement is
  reported beside it (`lossless_check_run_dtype`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from headstart.engines.vllm_runner import DTYPES, METHODS, Threads, VLLMError, acceptance, max_k, run_job, vllm_refusal


def export_for_vllm(head_dir: str | Path, model_dir: str | Path, out: Path, *,
                    allow_other_target: bool = False) -> dict[str, Any]:
    """Export the head at `head_dir` in the layout vLLM reads for its family, as `headstart export`
    does (a fresh target of only the parts a head reads, not an engine's kernel-swapped one, so the
    read-back check compares like with like) -> vLLM's speculative_config (k left out)."""
    from headstart.export import export_head
    from headstart.heads import load_head, read_head_config
    from headstart.models import load_target

    family = read_head_config(head_dir).head_type
    why = vllm_refusal(family)
    if why:
        raise VLLMError(f"vLLM does not serve this head: {why}")
    method, fmt = METHODS[family]
    target = load_target(Path(model_dir), dtype="fp32", layers=[])
    head = load_head(head_dir, target, allow_other_target=allow_other_target)
    why = vllm_refusal(family, head)
    if why:
        raise VLLMError(f"vLLM does not serve this head: {why}")
    export_head(head, target.to(head.dtype), fmt, out, overwrite=True)
    return {"method": method, "model": str(out)}


def _groups(n: int, batch: int) -> list[list[int]]:
    return [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]


def _job(target: Any, prompts: list[list[int]], plan: Any, dtype: str, engines: dict[str, Any],
         tasks: list[dict[str, Any]], stop_ids: list[int]) -> dict[str, Any]:
    longest = max(len(p) for p in prompts) + plan.max_tokens + 16
    return {"model": str(target.source_dir), "dtype": DTYPES[dtype], "max_model_len": longest, "kv_cache_gb": 1,
            "engines": engines, "prompts": prompts, "tasks": tasks,
            "sampling": {"max_tokens": plan.max_tokens, "temperature": 0.0, "seed": plan.seed,
                         "stop_token_ids": stop_ids}}


def vllm_eval(target: Any, prompts: list[list[int]], categories: list[str | None], plan: Any,
              heads: dict[str, Any], labels: dict[str, str], dtype: str, workdir: Path,
              stop_ids: list[int], threads: Threads | None = None) -> dict[str, Any]:
    """-> {"runs": rows, "ar": {T: {...}}, "skipped": [{head, reason}], "vllm": {...}}."""
    from headstart.eval_report import quantile as _quantile
    from headstart.inference.speculation import spec_method  # the method our rows name, so both engines' rows pair up

    engines: dict[str, Any] = {"plain": None}
    settings = []  # (engine name, head path, k)
    skipped = []
    for i, (path, head) in enumerate(heads.items()):
        why = vllm_refusal(head.config.head_type, head)
        if why:
            skipped.append({"head": path, "label": labels[path], "reason": why})
            continue
        spec = export_for_vllm(path, target.source_dir, workdir / "exports" / f"{i}-{head.config.head_type}",
                               allow_other_target=plan.allow_other_target)
        for k in plan.ks:
            if max_k(head) is not None and k > max_k(head):
                continue
            name = f"head{i}-k{k}"
            engines[name] = {**spec, "num_speculative_tokens": k}
            settings.append((name, path, k))
    groups = _groups(len(prompts), plan.batch_size)
    tasks = []  # each speculative engine's tasks together: with the plain one, two engines alive at most
    for name, _, _ in settings:
        for temp in plan.temperatures:
            for g in groups:
                for rep in range(plan.repeats):
                    order = ("plain", name) if rep % 2 == 0 else (name, "plain")
                    tasks += [{"engine": e, "prompts": g, "temperature": temp, "rep": rep} for e in order]
    if not settings:
        return {"runs": [], "ar": {}, "skipped": skipped, "vllm": {}}
    result = run_job(_job(target, prompts, plan, dtype, engines, tasks, stop_ids), workdir / f"run-{dtype}",
                     threads=threads, max_alive=2)
    fp32 = None
    if dtype != "fp32" and 0.0 in plan.temperatures:  # the lossless check needs vLLM's fp32 kernels
        ftasks = [{"engine": "plain", "prompts": g} for g in groups]
        ftasks += [{"engine": name, "prompts": g} for name, _, _ in settings for g in groups]
        fp32 = run_job(_job(target, prompts, plan, "fp32", engines, ftasks, stop_ids), workdir / "run-fp32",
                       threads=threads, inprocess=True)
    done = [dict(t, **r) for t, r in zip(tasks, result["tasks"])]
    runs, ar = [], {}
    for temp in plan.temperatures:
        plain_out: dict[int, list[int]] = {}
        for t in done:
            if t["engine"] == "plain" and t["temperature"] == temp and t["rep"] == 0:
                plain_out.update(zip(t["prompts"], t["outputs"]))
        rates = []
        for name, path, k in settings:
            mine = [t for t in done if t["engine"] == name and t["temperature"] == temp]
            pairs = _pairs(done, name, temp)
            ratios = sorted((s["tok"] / s["seconds"]) / (a["tok"] / a["seconds"]) for s, a in pairs)
            spec_tok = sum(s["tok"] for s, _ in pairs)
            spec_sec = sum(s["seconds"] for s, _ in pairs)
            ar_tok, ar_sec = sum(a["tok"] for _, a in pairs), sum(a["seconds"] for _, a in pairs)
            rates.append(ar_tok / ar_sec)
            total = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * k}
            first = [t for t in mine if t["rep"] == 0]
            for t in first:
                for key in ("drafts", "draft_tokens", "accepted"):
                    total[key] += t["spec"][key]
                pos = (t["spec"]["accepted_per_pos"] + [0] * k)[:k]
                total["accepted_per_pos"] = [a + b for a, b in zip(total["accepted_per_pos"], pos)]
            acc = acceptance(total, k)
            spec_out = {i: o for t in first for i, o in zip(t["prompts"], t["outputs"])}
            mid = len(ratios) // 2
            median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
            row = {"engine": "vllm", "head": path, "label": labels[path],
                   "head_type": heads[path].config.head_type, "method": spec_method(heads[path].config.head_type),
                   "k": k, "temperature": temp,
                   **acc, "tokens": spec_tok, "seconds": spec_sec, "tokens_per_s": spec_tok / spec_sec,
                   "ar_tokens_per_s": ar_tok / ar_sec, "speedup": median, "speedup_min": ratios[0],
                   "speedup_max": ratios[-1], "speedup_p25": _quantile(ratios, 0.25),
                   "speedup_p75": _quantile(ratios, 0.75),
                   "speedup_spread": (_quantile(ratios, 0.75) - _quantile(ratios, 0.25)) / median,
                   "timing_pairs": len(ratios), "vllm_method": result["engines"][name]["method"],
                   "tau_by_group": [1 + t["spec"]["accepted"] / t["spec"]["drafts"] if t["spec"]["drafts"] else None
                                    for t in first],
                   "tau_by_category": _by_category(first, categories)}
            if temp == 0:
                row["lossless_check_run_dtype"] = _same(spec_out, plain_out)
                if fp32 is None:
                    row["lossless_check"] = row["lossless_check_run_dtype"]
                else:
                    row["lossless_check"] = _fp32_check(fp32, name)
            runs.append(row)
        ar[str(temp)] = {"tokens_per_s": sorted(rates)[len(rates) // 2] if rates else None,
                         "outputs": [plain_out.get(i) for i in range(len(prompts))]}
    return {"runs": runs, "ar": ar, "skipped": skipped,
            "vllm": {"version": result["vllm_version"], "dtype": dtype, "threads": (threads or Threads()).mode,
                     "startup_seconds": {n: round(e["startup_seconds"], 1) for n, e in result["engines"].items()}}}


def _pairs(done: list[dict[str, Any]], name: str, temp: float) -> list[tuple[dict, dict]]:
    """(spec, plain) timing pairs: each spec task with the plain task run beside it on the same group."""
    out = []
    for i, t in enumerate(done):
        if t["engine"] != name or t["temperature"] != temp:
            continue
        mate = done[i - 1] if t["rep"] % 2 == 0 else done[i + 1]
        assert mate["engine"] == "plain" and mate["prompts"] == t["prompts"]
        out.append(({"tok": sum(map(len, t["outputs"])), "seconds": t["seconds"]},
                    {"tok": sum(map(len, mate["outputs"])), "seconds": mate["seconds"]}))
    return out


def _same(spec: dict[int, list[int]], plain: dict[int, list[int]]) -> str:
    differ = sum(spec[i] != plain.get(i) for i in spec)
    return "identical" if differ == 0 else f"differs in {differ} of {len(spec)}"


def _fp32_check(result: dict[str, Any], name: str) -> str:
    plain = {i: o for t in result["tasks"] if t["engine"] == "plain" for i, o in zip(t["prompts"], t["outputs"])}
    spec = {i: o for t in result["tasks"] if t["engine"] == name for i, o in zip(t["prompts"], t["outputs"])}
    return _same(spec, plain)


def _by_category(tasks: list[dict[str, Any]], categories: list[str | None]) -> dict[str, float]:
    """tau per prompt category, from the tasks whose prompts share one category (vLLM counts per run)."""
    per: dict[str, list[int]] = {}
    for t in tasks:
        cats = {categories[i] for i in t["prompts"]}
        if len(cats) == 1 and None not in cats and t["spec"]["drafts"]:
            c = per.setdefault(cats.pop(), [0, 0])
            c[0] += t["spec"]["accepted"]
            c[1] += t["spec"]["drafts"]
    return {c: 1 + a / n for c, (a, n) in sorted(per.items())}


def compare_engines(runs: list[dict[str, Any]]) -> None:
    """Beside each vLLM row, its tau minus ours for the same head, method, k and T, and whether that
    gap is larger than the prompt set's sampling noise: 2 x the standard error of the per-batch-group
    differences (paired: the groups are the same prompts in both engines). With fewer than two groups
    the gap is reported and `tau_differs` is None (not assessable)."""
    ours = {(r["head"], r["method"], r["k"], r["temperature"]): r for r in runs
            if r.get("engine", "headstart") == "headstart"}
    for r in runs:
        if r.get("engine") != "vllm":
            continue
        mate = ours.get((r["head"], r["method"], r["k"], r["temperature"]))
        if mate is None or r["tau"] is None or mate["tau"] is None:
            continue
        pairs = [(a, b) for a, b in zip(r.get("tau_by_group") or [], mate.get("tau_by_group") or [])
                 if a is not None and b is not None]
        se = _se([a - b for a, b in pairs])
        diff = r["tau"] - mate["tau"]
        r["tau_minus_headstart"] = diff
        r["tau_noise"] = 2 * se if se is not None else None
        r["tau_differs"] = abs(diff) > 2 * se if se is not None else None


def _se(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((x - m) ** 2 for x in values) / (len(values) - 1) / len(values))
