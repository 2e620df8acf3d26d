"""The files `headstart eval` writes: report.json, report.md and PNG plots, and which directories
it may write them into (a new or empty one, or an earlier eval report's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from headstart.errors import OutputError
from headstart.fileio import atomic_path, check_output_path

FORMAT = "headstart-eval/1"  # report.json's marker: a directory holding one may be written again
WIDE_SPREAD = 0.25  # (p75 - p25) / median of the per-group ratios past which a speedup is flagged


def head_labels(paths: list[str]) -> dict[str, str]:
    """A short, distinct label per head: its directory name, with as many parent names as it takes
    to tell two heads apart (runs/a/head-best and runs/b/head-best -> a/head-best, b/head-best)."""
    parts = {p: Path(p).resolve().parts for p in paths}
    labels = {}
    for p in paths:
        n = 1
        while n < len(parts[p]) and any(q != p and parts[q][-n:] == parts[p][-n:] for q in paths):
            n += 1
        labels[p] = "/".join(parts[p][-n:])
    return labels


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _label(run: dict[str, Any]) -> str:
    return run.get("label") or Path(run["head"]).name


def _plot_label(run: dict[str, Any]) -> str:
    return _label(run) + (" (vLLM)" if run.get("engine") == "vllm" else "")


def is_report_dir(path: str | Path) -> bool:
    """True for a directory an earlier `headstart eval` wrote (its report.json carries our marker;
    reports written before the marker existed are known by their top-level keys)."""
    f = Path(path) / "report.json"
    try:
        obj = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return _only_vllm_work(Path(path))
    return isinstance(obj, dict) and (obj.get("format") == FORMAT or
                                      {"runs", "heads", "engine", "ar", "settings"} <= set(obj))


def _only_vllm_work(path: Path) -> bool:
    """A report directory whose run stopped after vLLM's exports and jobs were written (`vllm/`), before
    the report: ours, so a rerun may use it."""
    try:
        names = {p.name for p in path.iterdir()}
    except OSError:
        return False
    work = path / "vllm"
    if names != {"vllm"} or not work.is_dir():
        return False
    inside = [p.name for p in work.iterdir()]
    return bool(inside) and all(n == "exports" or n.startswith("run-") for n in inside)


def check_report_dir(out: str | Path) -> Path:
    """Refuse a report directory before any work: only a new or empty directory, or an earlier
    eval report, is written (report.json, report.md and the plots are replaced there)."""
    path = check_output_path(out, replaces=is_report_dir, hint="it is not an earlier eval report; choose a new --out")
    if path.exists() and not path.is_dir():
        raise OutputError(f"{out}: is a file; --out names a report directory")
    return path


def write_reports(report: dict[str, Any], out: Path) -> list[Path]:
    out = check_report_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out}: cannot create the report directory ({e.strerror or e})") from None
    written = []
    with atomic_path(out / "report.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2))
    written.append(out / "report.json")
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text(markdown(report))
    written.append(out / "report.md")
    written += plots(report, out)
    return written


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [f"# headstart eval: {s.get('target', '?')} ({s.get('dtype', '?')}, {s.get('device', '?')})", "",
             f"{report['prompts']} prompts, up to {report['max_tokens']} new tokens, batch {report['batch_size']}, "
             f"seed {report['seed']}; torch {s['torch']}, {s['threads']} threads, CPU bf16 native: {s['cpu_bf16']}.",
             "", "| T | AR tok/s |", "|---|---|"]
    lines += [f"| {t} | {r['tokens_per_s']:.1f} |" for t, r in report["ar"].items()]
    lines += ["", "Speedup: the median of per-batch-group ratios to plain decoding run alternately on the same "
              "prompts (the middle half beside it; ⚠ when it is wider than 25 % of the median); `ngram (no "
              "training)` is prompt lookup, the baseline.", "",
              "| engine | head | method | k | T | tau | alpha | accept rate per position | tok/s | AR tok/s | speedup "
              "(p25..p75) | lossless |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        rate = " ".join(f"{x:.2f}" for x in r["accept_rate_per_pos"])
        alpha = f"{r['alpha']:.3f}" if r["alpha"] is not None else "-"
        tau = f"{r['tau']:.3f}" if r["tau"] is not None else "-"
        spread = f" ({r['speedup_p25']:.2f}..{r['speedup_p75']:.2f})" if "speedup_p25" in r else ""
        flag = " ⚠" if r.get("speedup_spread", 0) > WIDE_SPREAD else ""
        method = r["method"] + (f" ({r['draft_threshold']})" if r.get("draft_threshold") else "")
        lossless = r.get("lossless_check", "-")
        if r.get("lossless_check_run_dtype", lossless) != lossless:
            lossless += f" (fp32); {r['lossless_check_run_dtype']} ({report.get('vllm', {}).get('dtype', '?')})"
        lines.append(f"| {r.get('engine', 'headstart')} | {_label(r)} | {method} | {r['k']} | {r['temperature']} | "
                     f"{tau} | "
                     f"{alpha} | {rate} | {r['tokens_per_s']:.1f} | {r.get('ar_tokens_per_s', 0):.1f} | "
                     f"{r['speedup']:.2f}x{spread}{flag} | {lossless} |")
    lines += _engines_section(report)
    cats = [r for r in report["runs"] if r["tau_by_category"]]
    if cats:
        lines += ["", "## tau by prompt category", "", "| engine | head | method | k | T | " +
                  " | ".join(sorted(cats[0]["tau_by_category"])) + " |", "|---" * (5 + len(cats[0]["tau_by_category"]))
                  + "|"]
        for r in cats:
            lines.append(f"| {r.get('engine', 'headstart')} | {_label(r)} | {r['method']} | {r['k']} | "
                         f"{r['temperature']} | " +
                         " | ".join(f"{r['tau_by_category'].get(c, float('nan')):.3f}"
                                    for c in sorted(cats[0]["tau_by_category"])) + " |")
    return "\n".join(lines) + "\n"


def _engines_section(report: dict[str, Any]) -> list[str]:
    """vLLM beside ours: its version and settings, the heads it skipped, and each tau gap against the
    prompt set's noise, said plainly when it is larger."""
    v = report.get("vllm")
    if not v:
        return []
    lines = ["", "## vLLM beside headstart", "",
             f"vLLM {v.get('version', '?')} in {v.get('dtype', '?')}, threads: {v.get('threads', '?')}; greedy "
             "lossless is checked in fp32 (vLLM's bf16 kernels are not batch-invariant: a verify pass of k+1 rows "
             "rounds near-ties unlike a 1-row decode, so bf16 texts part without any fault of the head)."]
    ar = v.get("ar") or {}
    for t, r in ar.items():
        ours = (report.get("ar") or {}).get(t, {}).get("tokens_per_s")
        if r.get("tokens_per_s") and ours:
            lines.append(f"Plain decoding at T={t}: headstart {ours:.1f} tok/s, vLLM {r['tokens_per_s']:.1f} tok/s "
                         f"(ours / vLLM = {ours / r['tokens_per_s']:.2f}).")
    for s in v.get("skipped") or []:
        lines.append(f"- vLLM skipped {s['label']}: {s['reason']}")
    gaps = [r for r in report["runs"] if "tau_minus_headstart" in r]
    if gaps:
        lines += ["", "| head | k | T | tau headstart | tau vLLM | vLLM - ours | noise (2 SE, paired) | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in gaps:
            verdict = ("not assessable (fewer than 2 batch groups)" if r["tau_differs"] is None else
                       "**differ by more than the noise**" if r["tau_differs"] else "same within the noise")
            noise = f"±{r['tau_noise']:.3f}" if r["tau_noise"] is not None else "-"
            lines.append(f"| {_label(r)} | {r['k']} | {r['temperature']} | {r['tau'] - r['tau_minus_headstart']:.3f} | "
                         f"{r['tau']:.3f} | {r['tau_minus_headstart']:+.3f} | {noise} | {verdict} |")
        if any(r["tau_differs"] for r in gaps):
            lines += ["", "**The two engines accept this head differently, beyond the prompt set's noise**: check "
                      "the hidden state each feeds the head (aux layer ids, pre/post norm), d2t/t2d and position ids."]
    return lines


def plots(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    written = []
    if not runs:
        return written
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        key = (r["head"], r["method"], r.get("engine"))
        mates = [x["k"] for x in runs if (x["head"], x["method"], x.get("engine")) == key]
        if r["k"] == max(mates):
            ax.plot(range(1, len(r["accept_rate_per_pos"]) + 1), r["accept_rate_per_pos"], marker="o",
                    label=f"{_plot_label(r)} {r['method']} k={r['k']} T={r['temperature']}")
    ax.set(xlabel="draft position", ylabel="P(accepted up to here)", title="acceptance per position", ylim=(0, 1))
    ax.legend(fontsize=7)
    written.append(_save(fig, out / "accept_per_position.png"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((_plot_label(r), r["method"], r["temperature"]), []).append(r)
    for (name, method, temp), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["k"])
        a1.plot([r["k"] for r in rs], [r["tau"] or float("nan") for r in rs], marker="o",
                label=f"{name} {method} T={temp}")
        a2.plot([r["k"] for r in rs], [r["speedup"] for r in rs], marker="o", label=f"{name} {method} T={temp}")
    a1.set(xlabel="k", ylabel="tau", title="tau by k")
    a2.set(xlabel="k", ylabel="speedup vs AR", title="speedup by k")
    a2.axhline(1.0, color="grey", lw=0.8)
    a1.legend(fontsize=7)
    written.append(_save(fig, out / "tau_speedup_by_k.png"))
    cats = [r for r in runs if r["tau_by_category"]]
    if cats:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = sorted({c for r in cats for c in r["tau_by_category"]})
        width = 0.8 / len(cats)
        for i, r in enumerate(cats):
            ax.bar([j + i * width for j in range(len(names))], [r["tau_by_category"].get(c, 0) for c in names],
                   width, label=f"{_plot_label(r)} {r['method']} k={r['k']} T={r['temperature']}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30, fontsize=8)
        ax.set(ylabel="tau", title="tau by prompt category")
        ax.legend(fontsize=6)
        written.append(_save(fig, out / "tau_by_category.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path
