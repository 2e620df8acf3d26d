"""Precompute throughput: our serving forward vs HF `model(..., output_hidden_states=True)`, same
batches, same run; plus bytes per token of the stored shards in bf16 and fp8.

    .venv/bin/python benchmarks/precompute.py              # SmolLM2-135M bf16, 256 ShareGPT conversations
    .venv/bin/python benchmarks/precompute.py --conversations 64
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from headstart.assets import resolve_model
from headstart.config import DataConfig
from headstart.data.dataset import build_dataset
from headstart.models.llama import DTYPES, load_llama
from headstart.precompute.run import EngineForward, plan_batches
from headstart.precompute.shards import write_shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model("smollm2-135m")
    built = build_dataset(DataConfig(source="sharegpt", max_length=args.max_length, limit=args.conversations,
                                     heldout_fraction=0.0), str(model_dir), progress=False)
    seqs = [list(x) for x in built.train["input_ids"]]
    masks = [m for r in built.train["loss_mask"] for m in r]
    batches = plan_batches([len(s) for s in seqs], args.batch_tokens)
    tokens = sum(len(s) for s in seqs)
    model = load_llama(model_dir, args.dtype)
    ours = EngineForward(model, torch.device("cpu"), max(args.batch_tokens, args.max_length))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[args.dtype]).eval()
    ours(seqs[:1], [])  # warm-up both
    with torch.inference_mode():
        hf(torch.tensor([seqs[0]]), output_hidden_states=True)

    start = time.perf_counter()
    hs = [ours(seqs[a:b], [])[0] for a, b in batches]
    t_ours = time.perf_counter() - start
    start = time.perf_counter()
    with torch.inference_mode():
        for a, b in batches:
            chunk = seqs[a:b]
            width = max(len(s) for s in chunk)
            ids = torch.tensor([s + [0] * (width - len(s)) for s in chunk])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
            hf(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
    t_hf = time.perf_counter() - start
    print(f"SmolLM2-135M {args.dtype}: {len(seqs)} ShareGPT conversations, {tokens:,} tokens, "
          f"{len(batches)} batches of <= {args.batch_tokens} tokens, {torch.get_num_threads()} threads")
    print(f"{'':<28} {'tok/s':>9}")
    print(f"{'HF output_hidden_states':<28} {tokens / t_hf:>9.0f}")
    print(f"{'headstart precompute':<28} {tokens / t_ours:>9.0f}   ratio {t_hf / t_ours:.2f}x")
    hidden = torch.cat(hs)
    ids = torch.tensor([t for s in seqs for t in s])
    with tempfile.TemporaryDirectory() as d:
        for storage in ("bf16", "fp8"):
            rec = write_shard(Path(d) / f"{storage}.safetensors", 0, ids, torch.tensor(masks, dtype=torch.uint8),
                              [len(s) for s in seqs], hidden, None, storage)
            err = f", relative reconstruction error {rec.fp8_rel_error:.4f}" if rec.fp8_rel_error else ""
            print(f"{storage} shard: {rec.bytes / tokens:.1f} bytes/token (d = {hidden.shape[1]}){err}")


if __name__ == "__main__":
    main()
