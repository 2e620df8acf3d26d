"""Per-token bookkeeping of the engine, ours vs the previous scheme, one run side by side:

- text: incremental detokenisation vs decoding the whole output after every token (SmolLM2's tokenizer);
- metrics: the running acceptance histogram vs recomputing the summary from every step's record.

    .venv/bin/python benchmarks/bookkeeping.py [--tokens 2048]
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from transformers import AutoTokenizer

from headstart.assets import resolve_model
from headstart.hardware import describe
from headstart.inference.detok import IncrementalText
from headstart.inference.speculation import SpecMetrics


def full_decode_per_token(tok, ids):  # noqa: ANN001, ANN201
    for i in range(1, len(ids) + 1):
        text = tok.decode(ids[:i], skip_special_tokens=True)
    return text


def incremental(tok, ids):  # noqa: ANN001, ANN201
    inc = IncrementalText(tok)
    for i in range(1, len(ids) + 1):
        inc.update(ids[:i])
    return inc.final(ids)


def recomputed_summaries(steps):  # noqa: ANN001, ANN201
    accepted = []
    for a in steps:  # the old SpecMetrics: lists, summary rebuilt from them after every output
        accepted.append(a)
        n, k = len(accepted), 3
        [sum(x >= i + 1 for x in accepted) / n for i in range(k)]
        [sum(x == j for x in accepted) for j in range(k + 1)]


def running_summaries(steps):  # noqa: ANN001, ANN201
    m = SpecMetrics(positions=3)
    for a in steps:
        m.add(a, 3)
        m.summary()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    text = " ".join(["The quick brown fox jumps over the lazy dog — naïve café, 東京 🌊."] * 400)
    ids = tok(text, add_special_tokens=False)["input_ids"][: args.tokens]
    print(f"{platform.processor() or platform.machine()}; {describe()}; {len(ids)} output tokens")
    t0 = time.perf_counter()
    a = full_decode_per_token(tok, ids)
    t1 = time.perf_counter()
    b = incremental(tok, ids)
    t2 = time.perf_counter()
    assert a == b
    print(f"text     full decode per token {t1 - t0:8.3f} s   incremental {t2 - t1:8.3f} s   "
          f"ratio {(t1 - t0) / (t2 - t1):6.1f}x")
    rng = random.Random(0)
    steps = [rng.randrange(4) for _ in range(len(ids) // 2)]
    t0 = time.perf_counter()
    recomputed_summaries(steps)
    t1 = time.perf_counter()
    running_summaries(steps)
    t2 = time.perf_counter()
    print(f"metrics  summary from lists    {t1 - t0:8.3f} s   running     {t2 - t1:8.3f} s   "
          f"ratio {(t1 - t0) / (t2 - t1):6.1f}x  ({len(steps)} speculative steps)")


if __name__ == "__main__":
    main()
