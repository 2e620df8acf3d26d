"""Head families and learning rates at equal CPU time: heads trained from the same shards, each arm
given the steps its step cost buys in the same CPU time, then the engine's acceptance on the same
held-out prompts (greedy, k = the recipe's).

The shards are precomputed once with the eagle3 head's aux layers (they hold the last hidden state
too, so mtp arms read the same rows). `--cost FAMILY=X` prices a step of that family in mtp steps
(benchmarks/train.md measures it: `benchmarks/train.py --variants vd8192_ttt1,eagle3_vd8192_ttt1`).
Steps, not wall-clock limits, set each arm's budget, so a loaded machine slows the arms without
changing what they learn. Every arm is its family's shipped recipe apart from its learning rate, TTT and
steps: mtp and eagle3 arms recipes/smollm2-135m-mtp.yaml (eagle3 swaps the family only), eagle31 arms
recipes/smollm2-135m-eagle31.yaml (EAGLE-3.1 norms, a random layer, TTT 2); the same data, draft
vocabulary size and schedule shape. An arm's TTT defaults to its recipe's.

    .venv/bin/python benchmarks/head_budget.py --source runs/smollm2-135m-mtp/regenerated.jsonl \\
        --mtp-steps 394 --cost eagle3=1.055 --ttt-cost 2=2.3 --arms mtp:2e-3,eagle3:2e-3,mtp:1e-3,mtp:4e-3,eagle3:2e-3:2
    .venv/bin/python benchmarks/head_budget.py --source runs/smollm2-135m-mtp/regenerated.jsonl \\
        --shards runs/smollm2-135m-eagle31/precompute --cost eagle31=1.95 \\
        --arms mtp:4e-3,mtp:8e-3,eagle31:4e-3,eagle31:8e-3
    # the LK losses against the KL at equal steps and data (issue "A head that reaches tau 2"):
    .venv/bin/python benchmarks/head_budget.py --source sharegpt --limit 1000 --mtp-steps 150 --cost eagle31=1 \\
        --prompts 32 --max-tokens 128 --arms eagle31:4e-3,eagle31:4e-3:2:lk
    .venv/bin/python benchmarks/head_budget.py --source runs/sharegpt-all/regenerated.jsonl \\
        --shards runs/smollm2-135m-eagle31-all/precompute --mtp-steps 1100 --cost eagle31=1 --prompts 64 \\
        --max-tokens 128 --arms eagle31:4e-3,eagle31:4e-3:2:lk,eagle31:4e-3@head.init_from_target=true --minutes 86
    # the same arms on the first turns only (the shipped head's recipe; its shards from `headstart precompute`)
    .venv/bin/python benchmarks/head_budget.py --source runs/sharegpt-all/regenerated.jsonl \
        --data-from recipes/smollm2-135m-eagle31-first.yaml --shards runs/smollm2-135m-eagle31-first/precompute \
        --mtp-steps 1100 --cost eagle31=1 --prompts 64 --max-tokens 128 \
        --arms eagle31:4e-3,eagle31:4e-3:2:lk,eagle31:4e-3@head.init_from_target=true --minutes 86

Everything lands under runs/head-budget/ and resumes: rerunning skips what is done.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml
from common import arm_result, headstart_cli, print_arms, train_arm

from headstart.errors import ConfigError
from headstart.fileio import atomic_write_text
from headstart.recipe_io import apply_overrides, recipe_from_dict

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-mtp.yaml"
OUT = ROOT / "runs" / "head-budget"
RECIPES = {"mtp": RECIPE, "eagle3": RECIPE, "eagle31": ROOT / "recipes" / "smollm2-135m-eagle31.yaml"}
FAMILIES = tuple(RECIPES)


def _recipe(base: dict, name: str, family: str, source: str) -> dict:
    r = json.loads(json.dumps(base))
    r.pop("regenerate", None)
    r["name"] = f"head-budget-{name}"
    r["output_dir"] = str(OUT / name)
    r["data"]["source"] = source
    if family == "eagle3":
        r["head"]["type"] = "eagle3"
        r["head"]["aux_layer_ids"] = None  # layers 2, L//2, L-3
    r["logging"]["wandb"] = False
    return r


def _positive(text: str, what: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not x > 0:
        raise SystemExit(f"{what}: expected a positive number, got {text!r}")
    return x


def _slug(item: str) -> str:
    """An arm's @key=value in its run's name: the key's last part and the value, e.g. init_from_target-true."""
    key, _, value = item.partition("=")
    return f"{key.rsplit('.', 1)[-1]}-{value}".replace("/", "_")


def shards(base: dict, source: str) -> Path:
    """Precompute (resumable) the eagle3 recipe's shards: last hidden state + three aux layers."""
    r = _recipe(base, "shards", "eagle3", source)
    path = OUT / "shards.yaml"
    atomic_write_text(path, yaml.safe_dump(r, sort_keys=False))
    out = OUT / "shards" / "precompute"
    if not (out / "manifest.json").exists():
        headstart_cli("precompute", str(path), *(["--resume"] if (out / "run.json").exists() else []))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, help="the conversations to train on (the shipped recipe's data), a "
                                                    "file or an embedded dataset's name (sharegpt)")
    ap.add_argument("--limit", type=int, help="data.limit: read only the first N conversations of --source")
    ap.add_argument("--data-from", metavar="RECIPE",
                    help="every arm's and the shards' data section from this recipe (its source stays --source), "
                         "e.g. recipes/smollm2-135m-eagle31-first.yaml for its first turns (data.max_turns: 1)")
    ap.add_argument("--mtp-steps", type=int, default=394, help="steps of an mtp arm (others: mtp-steps / cost)")
    ap.add_argument("--cost", action="append", default=[], metavar="FAMILY=X",
                    help="a step of FAMILY's recipe (its TTT) in mtp steps (benchmarks/train.md), repeatable")
    ap.add_argument("--arms", default="mtp:2e-3,eagle3:2e-3",
                    help="family:lr[:ttt[:loss]][@key=value...] (ttt: the arm's train.ttt_steps, default the "
                         "recipe's; loss: its train.loss, kl (default), lk, lk_lambda or lk_alpha, at the same steps "
                         "as kl; @key=value: any other recipe key, e.g. @head.init_from_target=true)")
    ap.add_argument("--ttt-cost", action="append", default=[], metavar="TTT=X",
                    help="a step with train.ttt_steps TTT in TTT-1 steps of its family (repeatable)")
    ap.add_argument("--shards", help="shards precomputed already with the eagle3 aux layers (2, 15, 27) and the last "
                                     "state from --source, e.g. runs/smollm2-135m-eagle31/precompute")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for the engine's acceptance")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per held-out prompt")
    ap.add_argument("--minutes", type=float, help="a piece of the work: stop (checkpointed) after this long; the same "
                                                   "command continues")
    args = ap.parse_args()
    if args.minutes is not None and not args.minutes > 0:
        raise SystemExit(f"--minutes {args.minutes}: must be > 0")
    deadline = time.monotonic() + args.minutes * 60 if args.minutes is not None else None
    cost = {"mtp": 1.0}
    for c in args.cost:
        fam, _, x = c.partition("=")
        if fam not in FAMILIES or fam == "mtp":
            raise SystemExit(f"--cost {c!r}: expected FAMILY=X with FAMILY one of {', '.join(FAMILIES[1:])} "
                             "(an mtp step is the unit)")
        cost[fam] = _positive(x, f"--cost {c!r}")
    bases = {fam: yaml.safe_load(path.read_text()) for fam, path in RECIPES.items()}
    if args.data_from:
        try:
            data = yaml.safe_load(Path(args.data_from).read_text())["data"]
        except (OSError, yaml.YAMLError, TypeError, KeyError) as e:
            raise SystemExit(f"--data-from {args.data_from}: no recipe with a data section there ({e})") from None
        for base in bases.values():
            base["data"] = json.loads(json.dumps(data))
    ttt_cost = {1: 1.0}
    for c in args.ttt_cost:
        t, _, x = c.partition("=")
        if not t.isdigit() or int(t) < 1:
            raise SystemExit(f"--ttt-cost {c!r}: expected TTT=X with TTT a number of TTT steps (>= 1)")
        ttt_cost[int(t)] = _positive(x, f"--ttt-cost {c!r}")
    arms = []
    for spec in args.arms.split(","):
        head, *sets = spec.split("@")
        if any("=" not in item for item in sets):
            raise SystemExit(f"arm {spec!r}: each @ is followed by key=value, e.g. @head.init_from_target=true")
        fam, lr, ttt_text, loss = (head.split(":") + ["", ""])[:4] if head.count(":") in (1, 2, 3) else ("",) * 4
        loss = loss or "kl"
        if fam not in FAMILIES or not (ttt_text == "" or (ttt_text.isdigit() and int(ttt_text) >= 1)) \
                or loss not in ("kl", "lk", "lk_lambda", "lk_alpha"):
            raise SystemExit(f"arm {spec!r}: expected family:lr[:ttt[:loss]] with family one of {', '.join(FAMILIES)}"
                             ", ttt a number of TTT steps (>= 1) and loss kl, lk, lk_lambda or lk_alpha")
        rate = _positive(lr, f"arm {spec!r}: the learning rate")
        own = bases[fam]["train"]["ttt_steps"]
        ttt = int(ttt_text) if ttt_text else own
        if fam not in cost:
            raise SystemExit(f"arm {spec!r}: no --cost {fam}=X given (what one step of its recipe costs in mtp steps)")
        missing = sorted({ttt, own} - set(ttt_cost)) if ttt != own else []
        if missing:
            raise SystemExit(f"arm {spec!r}: TTT {ttt} instead of its recipe's TTT {own}: the ratio of the two is "
                             f"needed; give " + " ".join(f"--ttt-cost {t}=X" for t in missing) +
                             " (a step with that TTT in TTT-1 steps)")
        price = cost[fam] * (ttt_cost[ttt] / ttt_cost[own] if ttt != own else 1.0)
        steps = round(args.mtp_steps / price)
        if steps < 1:
            raise SystemExit(f"arm {spec!r}: {args.mtp_steps} mtp steps buy no step of it (cost {price:g})")
        arms.append((fam, rate, ttt, steps, loss, sets))
    if args.shards and not (Path(args.shards) / "manifest.json").is_file():
        raise SystemExit(f"--shards {args.shards}: no finished precompute there (no manifest.json)")
    from headstart.assets import DATASETS

    source = args.source if args.source in DATASETS else str(Path(args.source).resolve())
    if args.limit is not None:
        for base in bases.values():
            base["data"]["limit"] = args.limit
    results, recipes = {}, {}
    for fam, lr, ttt, steps, loss, sets in arms:
        base = bases[fam]
        name = f"{fam}-lr{lr:g}-{steps}" + (f"-ttt{ttt}" if ttt != base["train"]["ttt_steps"] else "") \
            + (f"-{loss}" if loss != "kl" else "") + "".join(f"-{_slug(item)}" for item in sets)
        if name in recipes:
            raise SystemExit(f"--arms: two arms make the same run {name}")
        r = _recipe(base, name, fam, source)
        r["train"].update(max_steps=steps, lr=lr, ttt_steps=ttt, loss=loss, warmup_steps=min(30, steps // 10),
                          val_every_steps=0,
                          val_prompts=args.prompts, val_max_tokens=args.max_tokens,
                          ckpt_every_steps=max(10, steps // 4))
        try:  # an arm's own keys, checked as `headstart train --set` checks them, before anything runs
            recipe_from_dict(r, f"arm {name}", apply_overrides(r, sets))
        except ConfigError as e:
            raise SystemExit(f"arm {name}: {e}") from None
        recipes[name] = (r, fam, lr, ttt, steps, loss, sets)
    OUT.mkdir(parents=True, exist_ok=True)
    shards_dir = Path(args.shards).resolve() if args.shards else shards(bases["eagle3"], source)
    for name, (r, fam, lr, ttt, steps, loss, sets) in recipes.items():
        r["train"]["shards_dir"] = str(shards_dir)
        path = OUT / f"{name}.yaml"
        atomic_write_text(path, yaml.safe_dump(r, sort_keys=False))
        train_arm(path, OUT / name, deadline)
        results[name] = arm_result(OUT / name, family=fam, lr=lr, ttt=ttt, steps=steps, loss=loss,
                                   **({"set": sets} if sets else {}))
    print(f"\nHeads at equal CPU time: a step costs {cost} mtp steps (TTT: {ttt_cost}); {args.prompts} held-out "
          f"prompts x {args.max_tokens} tokens, greedy k = {bases['mtp']['head']['k']}")
    print_arms(results)
    atomic_write_text(OUT / "results.json", json.dumps({"args": vars(args), "cost": cost, "ttt_cost": ttt_cost,
                                                        **results}, indent=2))


if __name__ == "__main__":
    main()
