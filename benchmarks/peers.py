"""A peer trained side by side: speculators 0.9.0's own eagle3 trainer on the hidden states headstart's
precompute wrote, beside `headstart train` on the same shards (benchmarks/peers.md has the figures and
the full sequence of commands). Runs in `.venv-serving` (speculators, its pins); it does not import
headstart, so it reads the shards by their documented layout (headstart/precompute/shards.py).

    .venv-serving/bin/python benchmarks/peers.py convert --shards runs/peers/precompute \
        --head runs/peers/ours/head-final --out runs/peers/spec-data
    .venv-serving/bin/python benchmarks/peers.py train --data runs/peers/spec-data \
        --verifier ~/.cache/headstart/models/smollm2-135m-v1 --out runs/peers/spec --steps 200 -- [speculators flags]

`convert` writes what speculators' `ArrowDataset` + hs_connectors `FileTransfer` read:
    <out>/                    a `datasets` dir (save_to_disk): input_ids int64 [T], loss_mask bool [T], seq_len
    <out>/hidden_states/hs_<i>.safetensors   hidden_states [T, A + 1, d] (the A aux states, then the last
                              pre-norm state: speculators applies the verifier's norm itself), token_ids [T]
    <out>/d2t-<V>.npy, t2d-<V>.npy   the draft vocabulary of our head (its checkpoint's d2t / t2d), so both
                              heads predict over the same tokens
Both sides store a per-token loss mask (1 = an assistant token); each trainer shifts it its own way.

`train` runs speculators.train.cli.main (what `speculators train` runs) with four patches (line numbers
are speculators 0.9.0's speculators/train/trainer.py):
  1. :227 `acc = torch.accelerator.current_accelerator()` is None on a CPU-only torch and the trainer
     falls back to "cuda"; the step's `torch.autocast("cuda", bf16)` (:539) then warns "CUDA is not
     available or torch_xla is imported. Disabling autocast." and runs fp32. Patched: the call answers
     torch.device("cpu") while the Trainer is built (the only place it is read), so speculators trains
     in bf16 autocast as `headstart train` does (precision bf16-mixed on this CPU).
  2. :221 `self.local_rank = get_local_rank()` is the int 0 and :348 `self.model.to(self.local_rank)`
     (and :533 each batch) moves to device 0: "RuntimeError: Cannot access accelerator device when none
     is available." Patched: get_local_rank answers "cpu" in the trainer module.
  3. :80 `_StepTimer.mark` calls `torch.accelerator.synchronize()` on every logged step: the same
     RuntimeError. Patched: without an accelerator, synchronize is a no-op (the CPU runs synchronously).
  4. `Trainer.run_training` runs `num_epochs` whole epochs; `max_steps` only stops the epoch it falls
     in and the next epoch would still take one step. Patched: num_epochs = ceil(steps / batches per
     epoch), so the run takes exactly `steps` optimizer steps (the LR schedule spans `max_steps`).
Two stock settings cannot run here and are flags, not patches: `--draft-attn-impl sdpa` (the default
simple_flex_attention stops at speculators/models/attention.py:55 with "NotImplementedError:
FlexAttention does not support backward on CPU"), `--loss-implementation eager` (the default fused loss
imports Triton, not installed: speculators/losses/utils.py:118).
Everything else is speculators' own: its config resolution, model construction from the verifier,
MultipackDistributedBatchSamplerV2 packing, KL loss, AdamW, LR schedule, checkpointer (save_pretrained in bf16).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file


def _shard_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _dequant(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return values
    return (values.float() * scale.unsqueeze(-1)).to(torch.bfloat16)  # fp8 e4m3 * per-row scale


def convert(shards: Path, head: Path, out: Path) -> None:
    """Our shards (+ our head's draft vocabulary) -> speculators' offline training layout."""
    from datasets import Dataset

    manifest = json.loads((shards / "manifest.json").read_text())
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: exists and is not empty; remove it first")
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    i, tokens, t0 = 0, 0, time.perf_counter()
    for rec in manifest["shards"]:
        t = _shard_tensors(shards / rec["name"])
        if "aux_hidden" not in t:
            raise SystemExit(f"{shards / rec['name']}: no aux_hidden (precompute with an eagle3 recipe)")
        hidden = _dequant(t["hidden"], t.get("hidden_scale"))  # (N, d)
        aux = _dequant(t["aux_hidden"], t.get("aux_scale"))  # (N, A, d)
        off = t["seq_offsets"].tolist()
        for s in range(len(off) - 1):
            a, b = off[s], off[s + 1]
            ids = t["input_ids"][a:b].long()  # (T,)
            states = torch.cat([aux[a:b], hidden[a:b].unsqueeze(1)], dim=1).to(torch.bfloat16)  # (T, A + 1, d)
            save_file({"hidden_states": states.contiguous(), "token_ids": ids.contiguous()},
                      str(hs_dir / f"hs_{i}.safetensors"))
            rows["input_ids"].append(ids.tolist())
            rows["loss_mask"].append(t["loss_mask"][a:b].bool().tolist())
            rows["seq_len"].append(b - a)
            i, tokens = i + 1, tokens + (b - a)
    ds = Dataset.from_dict(rows)
    ds.set_format("torch", columns=["input_ids", "loss_mask"], output_all_columns=True)
    ds.save_to_disk(str(out))
    with safe_open(str(head / "model.safetensors"), "pt") as f:
        d2t, t2d = f.get_tensor("d2t").long(), f.get_tensor("t2d").bool()
    v = d2t.numel()
    np.save(out / f"d2t-{v}.npy", d2t.numpy())
    np.save(out / f"t2d-{v}.npy", t2d.numpy())
    print(f"convert: {i} sequences, {tokens:,} tokens, aux layers {manifest['captured']['aux_layers']}, "
          f"draft vocabulary {v:,} -> {out} ({time.perf_counter() - t0:.0f} s)")


def train(data: Path, verifier: str, out: Path, steps: int, extra: list[str]) -> None:
    """speculators.train.cli.main on the CPU, `steps` optimizer steps (module docstring: the patches)."""
    import speculators.train.cli as spec_cli
    import speculators.train.trainer as spec_trainer
    from speculators.train.config import TrainConfig

    argv = ["--verifier-name-or-path", verifier, "--data-path", str(data), "--save-path", str(out / "checkpoints"),
            "--log-dir", str(out / "logs"), "--max-steps", str(steps), "--num-workers", "0",
            "--loss-implementation", "eager", *extra]
    cfg = TrainConfig.resolve(argv)

    per_epoch: list[int] = []
    make_loaders = spec_cli.create_train_val_loaders

    def loaders(**kw):
        train_loader, val_loader = make_loaders(**kw)
        per_epoch.append(len(train_loader))
        return train_loader, val_loader

    def trainer_config(**kw):
        kw["num_epochs"] = math.ceil(steps / per_epoch[0])  # patch 4
        print(f"peers: {per_epoch[0]} packed batches per epoch -> {kw['num_epochs']} epochs, {steps} steps")
        return spec_trainer.TrainerConfig(**kw)

    class CpuTrainer(spec_trainer.Trainer):
        def __init__(self, *a, **kw):
            real = torch.accelerator.current_accelerator
            torch.accelerator.current_accelerator = lambda *x, **y: torch.device("cpu")  # patch 1
            try:
                super().__init__(*a, **kw)
            finally:
                torch.accelerator.current_accelerator = real

    spec_cli.create_train_val_loaders = loaders
    spec_cli.TrainerConfig = trainer_config
    spec_cli.Trainer = CpuTrainer
    spec_trainer.get_local_rank = lambda: "cpu"  # patch 2
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *x, **y: None  # patch 3
    t0 = time.perf_counter()
    spec_cli.main(cfg)
    wall = time.perf_counter() - t0
    (out / "peers_train.json").write_text(json.dumps({"steps": steps, "wall_s": wall, "argv": argv}, indent=2))
    print(f"peers: speculators trained {steps} steps in {wall / 60:.1f} min -> {out / 'checkpoints'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="headstart shards -> speculators' offline data layout")
    c.add_argument("--shards", type=Path, required=True)
    c.add_argument("--head", type=Path, required=True, help="our head checkpoint: its d2t / t2d are used")
    c.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("train", help="speculators' eagle3 trainer on the CPU")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--verifier", required=True, help="the target's HF directory")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more `speculators train` flags")
    a = p.parse_args(argv)
    # A script here named like an installed package would shadow it (tests/test_layering.py checks the names).
    here = Path(__file__).resolve().parent
    sys.path[:] = [x for x in sys.path if Path(x or ".").resolve() != here]
    if a.cmd == "convert":
        convert(a.shards, a.head, a.out)
    else:
        train(a.data, a.verifier, a.out, a.steps, [x for x in a.extra if x != "--"])


if __name__ == "__main__":
    main(sys.argv[1:])
