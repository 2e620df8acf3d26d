"""Print where `make quickstart` left everything and its headline numbers (from the eval report)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(run: str) -> int:
    root = Path(run)
    report = json.loads((root / "eval" / "report.json").read_text())
    train = json.loads((root / "metrics.json").read_text())
    print("\nquickstart: done. Everything is under", root)
    print(f"  shards          {root / 'precompute'}")
    print(f"  trained head    {root / 'head-best'}  (step {train.get('step')}, {train.get('tokens'):,} tokens, "
          f"validation tau {train.get('tau') or float('nan'):.3f})")
    print(f"  curves          {root / 'metrics.csv'}")
    print(f"  eval report     {root / 'eval' / 'report.md'} (+ report.json, PNG plots)")
    print(f"  export          {root / 'export' / 'vllm'} (vLLM / speculators eagle3), {root / 'export' / 'native'} "
          "(ours); where each head serves: below")
    ar = {t: r["tokens_per_s"] for t, r in report["ar"].items()}
    print(f"\n  {report['prompts']} held-out ShareGPT prompts, {report['settings'].get('dtype')}, "
          f"AR {', '.join(f'{v:.1f} tok/s (T={t})' for t, v in ar.items())}")
    for r in report["runs"]:
        name = _name(r["head"]) if r.get("head") else r.get("label", "-")
        tau = f"{r['tau']:.3f}" if r.get("tau") is not None else "-"
        spread = f" ({r['speedup_p25']:.2f}..{r['speedup_p75']:.2f})" if "speedup_p25" in r else ""
        print(f"  {r.get('engine', 'headstart'):<9} {name:<36} {r['method']:<8} k={r['k']}  tau {tau}  "
              f"speedup {r['speedup']:.2f}x{spread}  "
              f"lossless {r.get('lossless_check', '-')}")
    heads = list(dict.fromkeys(r["head"] for r in report["runs"] if r.get("head")))
    if heads:
        print("\n  where each head serves (`headstart export HEAD --format F`):")
        for head, lines in zip(heads, serving_lines(heads, report["settings"].get("target", "smollm2-135m")),
                               strict=True):
            print(f"  {_name(head):<36} " + "; ".join(lines))
    v = report.get("vllm")
    if v:
        print(f"\n  vLLM {v.get('version')} ({v.get('dtype')}) ran the same prompts; serve the trained head with:\n"
              f"    vllm serve {report['settings'].get('model_dir', 'SMOLLM2_DIR')} --speculative-config "
              f"'{{\"method\": \"eagle3\", \"model\": \"{root / 'export' / 'vllm'}\", \"num_speculative_tokens\": 3}}'")
        for s in v.get("skipped") or []:
            print(f"  vLLM skipped {_name(s['head'])}: {s['reason'][:120]}")
    return 0


def _name(head: str) -> str:
    return Path(head).parent.name + "/" + Path(head).name


def serving_lines(heads: list[str], target: str) -> list[list[str]]:
    """headstart.export.serving's answer for each head checkpoint, on the target loaded once."""
    from headstart.assets import resolve_model
    from headstart.export.serving import summary
    from headstart.heads import load_head
    from headstart.models.llama import load_llama

    model = load_llama(resolve_model(target), "fp32")
    return [summary(load_head(h, model)) for h in heads]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/quickstart"))
