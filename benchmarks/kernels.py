"""The row-invariant linear kernel (headstart.kernels) against torch's F.linear, on SmolLM2-135M's
own weights, by rows per call: 1 row is a plain decode step, k + 1 rows a chain verify, B x (k + 1)
a batched verify. What matters for speculation is the cost of M rows over the cost of one.

    .venv/bin/python benchmarks/kernels.py            # every linear of the model, M = 1, 2, 4, 8, 16
    .venv/bin/python benchmarks/kernels.py --reps 9

Every linear of the target is called in model order, as a forward does, so the weights come from
wherever a forward finds them (L3 or memory), not from a cache warmed by repeating one matmul.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from headstart.assets import resolve_model
from headstart.hardware import describe, resolve_dtype
from headstart.kernels import rowwise
from headstart.models.llama import load_llama
from headstart.nn.linear import Linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16", help="rows per call")
    ap.add_argument("--reps", type=int, default=7, help="passes over the model per setting (median)")
    args = ap.parse_args()
    kernels = rowwise()
    if kernels is None:
        raise SystemExit("the row-invariant kernels could not be built here")
    dtype = resolve_dtype("auto")
    target = load_llama(resolve_model("smollm2-135m"), dtype=dtype)
    lins = [m for m in target.modules() if isinstance(m, Linear)]
    packed = [kernels.pack_linear(m.weight.detach()) for m in lins]
    mb = sum(m.weight.numel() * m.weight.element_size() for m in lins) / 2**20
    print(f"{describe()}; {dtype}; {len(lins)} linears, {mb:.0f} MiB of weights; {torch.get_num_threads()} threads")
    rows = [int(r) for r in args.rows.split(",")]
    ours, theirs = {}, {}
    with torch.inference_mode():
        for m in rows:
            xs = {n.in_features: torch.randn(m, n.in_features).to(dtype) for n in lins}
            a, b = [], []
            for _ in range(args.reps):  # alternated, so a load change on the machine hits both alike
                t = time.perf_counter()
                for n, p in zip(lins, packed):
                    kernels.linear_packed(xs[n.in_features], p, n.out_features, None)
                a.append(time.perf_counter() - t)
                t = time.perf_counter()
                for n in lins:
                    F.linear(xs[n.in_features], n.weight)
                b.append(time.perf_counter() - t)
            ours[m], theirs[m] = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    print(f"\n{'rows':>5} {'ours ms':>9} {'torch ms':>9} {'torch/ours':>11} {'ours / 1 row':>13} {'torch / 1 row':>14}")
    for m in rows:
        print(f"{m:>5} {ours[m]:>9.2f} {theirs[m]:>9.2f} {theirs[m] / ours[m]:>10.2f}x "
              f"{ours[m] / ours[rows[0]]:>13.2f} {theirs[m] / theirs[rows[0]]:>14.2f}")


if __name__ == "__main__":
    main()
