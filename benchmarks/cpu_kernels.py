"""The row-invariant linear kernel (headstart.kernels) against torch's F.linear, on SmolLM2-135M's
own weights, by rows per call: 1 row is a plain decode step, k + 1 rows a chain verify, B x (k + 1)
a batched verify. What matters for speculation is the cost of M rows over the cost of one.

    .venv/bin/python benchmarks/cpu_kernels.py            # every linear of the model, M = 1, 2, 4, 8, 16
    .venv/bin/python benchmarks/cpu_kernels.py --reps 9

Every linear of the target is called in model order, as a forward does, so the weights come from
wherever a decode step finds them (L3 or memory), not from a cache warmed by repeating one matmul.
HEADSTART_AMX=0 measures the AVX-512 kernel on a CPU with AMX.
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
from headstart.models.llama import DTYPES, load_llama
from headstart.nn.linear import Linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16", help="rows per call")
    ap.add_argument("--reps", type=int, default=5, help="timed passes over the model per block (3 blocks; median)")
    args = ap.parse_args()
    kernels = rowwise()
    if kernels is None:
        raise SystemExit("the row-invariant kernels could not be built here")
    name = resolve_dtype("auto")
    target = load_llama(resolve_model("smollm2-135m"), dtype=name)
    dtype = DTYPES[name]
    lins = [m for m in target.modules() if isinstance(m, Linear)]
    packed = [kernels.pack_linear(m.weight.detach()) for m in lins]
    mb = sum(m.weight.numel() * m.weight.element_size() for m in lins) / 2**20
    print(f"{describe()}; {name}; the linear kernel on {kernels.linear_isa()}; {len(lins)} linears, "
          f"{mb:.0f} MiB of weights; {torch.get_num_threads()} threads")
    rows = [int(r) for r in args.rows.split(",")]
    ours, theirs = {}, {}
    with torch.inference_mode():
        for m in rows:
            xs = {n.in_features: torch.randn(m, n.in_features).to(dtype) for n in lins}
            a, b = [], []
            # Blocks of passes, alternated (a load change on the machine hits both alike); the first
            # pass of a block is dropped: the other kernel's weights had just pushed ours out of L3.
            for _ in range(3):
                ours_run = lambda x, n, p: kernels.linear_packed(x, p, n.out_features, n.in_features, None)  # noqa: E731
                for times, run in ((a, ours_run), (b, lambda x, n, p: F.linear(x, n.weight))):
                    for rep in range(args.reps + 1):
                        t = time.perf_counter()
                        for n, p in zip(lins, packed):
                            run(xs[n.in_features], n, p)
                        if rep:
                            times.append(time.perf_counter() - t)
            ours[m], theirs[m] = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    print(f"\n{'rows':>5} {'ours ms':>9} {'torch ms':>9} {'torch/ours':>11} {'ours / 1 row':>13} {'torch / 1 row':>14}")
    for m in rows:
        print(f"{m:>5} {ours[m]:>9.2f} {theirs[m]:>9.2f} {theirs[m] / ours[m]:>10.2f}x "
              f"{ours[m] / ours[rows[0]]:>13.2f} {theirs[m] / theirs[rows[0]]:>14.2f}")


if __name__ == "__main__":
    main()
