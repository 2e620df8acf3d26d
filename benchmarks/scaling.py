"""The data-scaling curve of a head recipe: the engine's held-out tau (greedy, the recipe's k) against
training tokens, and against unique conversations at a fixed token budget, with a log-linear fit of each.

Two sets of runs from the same shards (or, --online, the same conversations with no shards), each run the recipe
apart from the keys named here:
- tokens: one run of --steps steps over all the training conversations, validated --points times on the
  same held-out prompts (train.val_every_steps; --prompts prompts x --max-tokens tokens each);
- conversations: one run per --sizes N, trained on the first N conversations only (train.max_sequences)
  for --size-steps steps each (the same tokens, the same schedule), validated at its end. "First N" is the
  training split's order (the source file's): a size is a prefix, not a random sample, and with
  data.split_key id_prefix the chunks X_0, X_1 of one ShareGPT chat are neighbouring rows, each counted.
  A size of every conversation with --size-steps equal to --steps is the tokens run's last point (not trained
  twice). Without --sizes only the tokens run is made (results and plot of that curve); a later call with --sizes
  and the same tokens settings finds that run finished and adds the size runs.
Every point is tau of the run's own engine validation: the same prompts, the same code path as `headstart
eval`. The fit is tau = a + b ln(x) (acceptance grows log-linearly with data: Scylla, arXiv 2505.07858),
with the local slope between neighbouring points (where the curve bends) and what it predicts at 10x.

    .venv/bin/python benchmarks/scaling.py --recipe recipes/smollm2-135m-eagle31-all.yaml \\
        --source runs/sharegpt-all/regenerated.jsonl --steps 4400 --points 8 --sizes 2000,4000,8000,16000 \\
        --size-steps 1100 --prompts 64 --max-tokens 128

Runs land under runs/scaling/ (or --out) and resume: rerunning skips what is done and continues a run from
its last checkpoint. Writes results.json and scaling.png there and prints the tables for scaling.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import yaml
from common import cpu_name, headstart_cli, train_arm

from headstart.fileio import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]


def fit_log(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares tau = a + b ln(x): a, b, R^2."""
    if len(xs) < 2:
        raise ValueError("a fit needs at least two points")
    ls = [math.log(x) for x in xs]
    mx, my = sum(ls) / len(ls), sum(ys) / len(ys)
    sxx = sum((v - mx) ** 2 for v in ls)
    if sxx == 0:
        raise ValueError("a fit needs at least two different x")
    b = sum((v - mx) * (y - my) for v, y in zip(ls, ys)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * v) ** 2 for v, y in zip(ls, ys))
    return {"a": a, "b": b, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def local_slopes(xs: list[float], ys: list[float]) -> list[float]:
    """d tau / d ln(x) between neighbouring points: a falling slope is where the curve bends."""
    return [(y1 - y0) / math.log(x1 / x0) for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:])]


def standard_error(histogram: list[int]) -> float:
    """tau's standard error from a validation's accepted-drafts histogram (draft steps taken as independent:
    steps of one prompt are not, so the real error is somewhat larger)."""
    n = sum(histogram)
    mean = sum(i * c for i, c in enumerate(histogram)) / n
    return math.sqrt(sum(c * (i - mean) ** 2 for i, c in enumerate(histogram)) / n / n)


def _recipe(base: dict, out: Path, name: str, source: str | None, shards: Path | None, train: dict) -> Path:
    r = json.loads(json.dumps(base))
    r.pop("regenerate", None)
    r["name"] = f"scaling-{name}"
    r["output_dir"] = str(out / name)
    if source:
        r.setdefault("data", {})["source"] = source
    r.setdefault("logging", {})["wandb"] = False
    # the training split's shards where the script looks for them; no epoch cap under a size's token budget
    r.setdefault("precompute", {}).update(split="train", output_dir=None)
    where = {"source": "shards", "shards_dir": str(shards)} if shards else {"source": "online", "shards_dir": None}
    r.setdefault("train", {}).update(**where, epochs=None, **train)
    path = out / f"{name}.yaml"
    atomic_write_text(path, yaml.safe_dump(r, sort_keys=False))
    return path


def _shard_lengths(shards: Path) -> list[int]:
    from headstart.train.data import ShardSequences

    return ShardSequences(shards).lengths


def _train_lengths(path: Path) -> list[int]:
    """Token counts of the recipe's training split, in its order (what train.max_sequences cuts)."""
    from headstart.assets import resolve_model
    from headstart.data.dataset import build_dataset
    from headstart.recipe_io import load_recipe

    recipe = load_recipe(path)
    train = build_dataset(recipe.data, str(resolve_model(recipe.target.model)), progress=False).train
    return [len(ids) for ids in train["input_ids"]]


def _val_rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "val"]
    if not rows:
        raise SystemExit(f"{run}: finished without a validation row in metrics.csv (train.val_prompts 0?)")
    return [{"step": int(r["step"]), "tokens": int(r["tokens"]), "tau": float(r["tau"]),
             "accept_rate_per_pos": json.loads(r["accept_rate_per_pos"])} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, required=True, help="the head recipe every run starts from")
    ap.add_argument("--source", help="its conversations (data.source) if not the recipe's")
    ap.add_argument("--shards", type=Path, help="finished precompute of those conversations with the recipe's head "
                                                "(default: precomputed into OUT/shards)")
    ap.add_argument("--steps", type=int, required=True, help="steps of the tokens run (the longest)")
    ap.add_argument("--points", type=int, default=6, help="validations of the tokens run (>= 5 for the curve)")
    ap.add_argument("--sizes", help="conversation counts for the second curve, e.g. 100,200,400 (none: the tokens "
                                     "curve alone; a later call with --sizes reuses its run)")
    ap.add_argument("--size-steps", type=int, help="steps of each size run (the fixed token budget)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts per validation")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per held-out prompt")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "scaling")
    ap.add_argument("--online", action="store_true", help="no shards: every run computes the target's states in its "
                                                          "steps (train.source online; no disk, nothing to carry)")
    ap.add_argument("--minutes", type=float, help="a piece of the work: stop (checkpointed) after this long; a rerun "
                                                   "continues")
    args = ap.parse_args()
    if args.minutes is not None and not args.minutes > 0:
        raise SystemExit(f"--minutes {args.minutes}: must be > 0")
    deadline = time.monotonic() + args.minutes * 60 if args.minutes is not None else None
    sizes = _sizes(args.sizes, args.size_steps)
    if args.points < 2 or args.steps < args.points:
        raise SystemExit("--points >= 2 and --steps >= --points")
    base = yaml.safe_load(args.recipe.read_text())
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    source = str(Path(args.source).resolve()) if args.source else None
    if args.online and args.shards:
        raise SystemExit("--online and --shards: give one")
    shards = None if args.online else args.shards.resolve() if args.shards else out / "shards" / "precompute"
    if shards and not (shards / "manifest.json").is_file():
        if args.shards:
            raise SystemExit(f"--shards {args.shards}: no finished precompute there (no manifest.json)")
        path = _recipe(base, out, "shards", source, shards, {})
        headstart_cli("precompute", str(path), *(["--resume"] if (shards / "run.json").exists() else []))
    lengths = _train_lengths(_recipe(base, out, "data", source, None, {})) if args.online else _shard_lengths(shards)
    if len({min(n, len(lengths)) for n in sizes}) < len(sizes):
        raise SystemExit(f"--sizes {args.sizes!r}: the shards hold {len(lengths):,} conversations; give at most one "
                         "size at or above that (it trains on all of them)")
    val = {"val_prompts": args.prompts, "val_max_tokens": args.max_tokens}
    # a run's name carries what its points depend on: a rerun with other settings trains anew, never mixes
    evals = f"p{args.prompts}x{args.max_tokens}"
    tokens_run = f"tokens-{args.steps}-v{args.points}-{evals}"
    train_arm(_recipe(base, out, tokens_run, source, shards, {
        **val, "max_steps": args.steps, "val_every_steps": args.steps // args.points,
        "ckpt_every_steps": max(10, args.steps // 20)}), out / tokens_run, deadline)
    curve = _val_rows(out / tokens_run)
    by_size = {}
    for n in sizes:
        name = f"convs-{min(n, len(lengths))}-{args.size_steps}-{evals}"
        if n >= len(lengths) and args.size_steps == args.steps:
            name = tokens_run  # every conversation for the same steps: the tokens run is that size's run
        else:
            train_arm(_recipe(base, out, name, source, shards, {
                **val, "max_steps": args.size_steps, "val_every_steps": 0,
                "ckpt_every_steps": max(10, args.size_steps // 10),
                "max_sequences": n if n < len(lengths) else None}), out / name, deadline)
        last = _val_rows(out / name)[-1]
        final = json.loads((out / name / "metrics.json").read_text())
        by_size[n] = {**last, "unique_tokens": sum(lengths[:n]), "tau_se": standard_error(final["accept_histogram"])}
    result = {"cpu": cpu_name(), "recipe": args.recipe.name, "shards": str(shards) if shards else "online",
              "conversations": len(lengths),
              "args": {k: str(v) for k, v in vars(args).items()}, "tokens_curve": curve, "size_curve": by_size}
    xs, ys = [r["tokens"] for r in curve], [r["tau"] for r in curve]
    result["tokens_fit"] = fit = fit_log(xs, ys)
    result["tokens_slopes"] = local_slopes(xs, ys)
    ns = [min(n, len(lengths)) for n in sizes]
    if sizes:
        result["size_fit"] = fit_log(ns, [by_size[n]["tau"] for n in sizes])
        result["size_slopes"] = local_slopes(ns, [by_size[n]["tau"] for n in sizes])
    atomic_write_text(out / "results.json", json.dumps(result, indent=2))
    _plot(result, out / "scaling.png")
    k = base["head"]["k"]
    print(f"\n{cpu_name()}; {args.recipe.name}; {len(lengths):,} training conversations ({sum(lengths):,} tokens); "
          f"tau greedy k = {k}, {args.prompts} held-out prompts x {args.max_tokens} tokens\n")
    print("| step | training tokens | epochs | tau | accept rate per position | slope to next (d tau / d ln T) |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(curve):
        slope = f"{result['tokens_slopes'][i]:+.3f}" if i < len(curve) - 1 else ""
        print(f"| {r['step']} | {r['tokens']:,} | {r['tokens'] / sum(lengths):.2f} | {r['tau']:.3f} | "
              f"{' / '.join(f'{a:.2f}' for a in r['accept_rate_per_pos'])} | {slope} |")
    print(f"\nfit tau = {fit['a']:.3f} + {fit['b']:.4f} ln(tokens), R^2 {fit['r2']:.3f}; at 10x the longest run "
          f"({10 * xs[-1]:,} tokens) it predicts tau {fit['a'] + fit['b'] * math.log(10 * xs[-1]):.3f}\n")
    if sizes:
        _print_sizes(result, sizes, ns, lengths)
    print(f"\n{out / 'results.json'}, {out / 'scaling.png'}")


def _sizes(text: str | None, steps: int | None) -> list[int]:
    if text is None:
        if steps is not None:
            raise SystemExit("--size-steps without --sizes")
        return []
    try:
        sizes = sorted({int(s) for s in text.split(",")})
    except ValueError:
        raise SystemExit(f"--sizes {text!r}: expected comma-separated conversation counts") from None
    if len(sizes) < 2 or sizes[0] < 1:
        raise SystemExit(f"--sizes {text!r}: at least two counts, each >= 1")
    if steps is None or steps < 1:
        raise SystemExit("--sizes needs --size-steps >= 1")
    return sizes


def _print_sizes(result: dict, sizes: list[int], ns: list[int], lengths: list[int]) -> None:
    by_size, sfit = result["size_curve"], result["size_fit"]
    print("| conversations | unique tokens | training tokens | tau (± s.e.) | accept rate per position |")
    print("|---|---|---|---|---|")
    for n in sizes:
        r = by_size[n]
        print(f"| {min(n, len(lengths)):,} | {r['unique_tokens']:,} | {r['tokens']:,} | {r['tau']:.3f} ± "
              f"{r['tau_se']:.3f} | "
              f"{' / '.join(f'{a:.2f}' for a in r['accept_rate_per_pos'])} |")
    print(f"\nfit tau = {sfit['a']:.3f} + {sfit['b']:.4f} ln(conversations), R^2 {sfit['r2']:.3f}; at 10x "
          f"({10 * ns[-1]:,} conversations) it predicts tau {sfit['a'] + sfit['b'] * math.log(10 * ns[-1]):.3f}")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sized = bool(result["size_curve"])
    fig, axes = plt.subplots(1, 2 if sized else 1, figsize=(11 if sized else 6, 4), squeeze=False)
    a, b = axes[0][0], axes[0][-1]
    panels = [(a, [r["tokens"] for r in result["tokens_curve"]], [r["tau"] for r in result["tokens_curve"]],
               result["tokens_fit"], "training tokens")]
    if sized:
        panels.append((b, [min(int(n), result["conversations"]) for n in result["size_curve"]],
                       [r["tau"] for r in result["size_curve"].values()], result["size_fit"], "unique conversations"))
    for ax, xs, ys, fit, label in panels:
        se = [r.get("tau_se", 0.0) for r in (result["tokens_curve"] if ax is a else result["size_curve"].values())]
        ax.errorbar(xs, ys, yerr=se, fmt="o-", capsize=3, label="tau (engine, held-out, greedy; ± s.e.)")
        grid = [xs[0] * (10 * xs[-1] / xs[0]) ** (i / 50) for i in range(51)]
        line = [fit["a"] + fit["b"] * math.log(x) for x in grid]
        ax.set_ylim(min(ys + line) - 0.05, max(ys + line) + 0.05)  # noise is not stretched to the axes' height
        ax.plot(grid, line, "--", lw=1,
                label=f"{fit['a']:.2f} + {fit['b']:.3f} ln x (R² {fit['r2']:.2f})")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("tau")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    if sized:
        b.set_title("at a fixed training-token budget", fontsize=9)
    fig.suptitle(f"{result['recipe']}: {result['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
