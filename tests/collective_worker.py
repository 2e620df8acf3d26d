"""One rank of a 2-process gloo training run for tests/test_collectives.py, launched by torchrun.

It runs the real training path of an 8-GPU job (Lightning's ModelParallelStrategy = FSDP2, or DDP;
`HeadModule.configure_model` and `training_step`) on micro-batches chosen per rank, so that the ranks
see the data that breaks collectives on real runs: a micro-batch with no dflash anchor on one rank
only, MoE experts that get no token on one rank only, a non-finite micro-batch after an accumulated
one. The process group times out after TIMEOUT_S: a rank left waiting in a collective fails instead
of hanging. Rank 0 writes the trained head's whole state to OUT (torch.save).

    torchrun --nproc-per-node 2 tests/collective_worker.py CASE TARGET_DIR OUT [--reference]
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch

TIMEOUT_S = 90


def _batch(target, lens: list[int], seed: int, aux: list[int], poison: bool = False):
    """A packed micro-batch as shards hold it: random tokens, states of the target's scale, every row supervised."""
    from headstart.heads.base import PackedBatch

    g = torch.Generator().manual_seed(seed)
    n, d = sum(lens), target.config.hidden_size
    ids = torch.randint(2, target.config.vocab_size, (n,), generator=g)
    hidden = torch.randn(n, d, generator=g)
    if poison:
        hidden[0] = float("inf")  # a non-finite teacher: the micro-batch's loss is not finite
    aux_hidden = torch.randn(n, len(aux), d, generator=g) if aux else None
    return PackedBatch(ids, lens, hidden, aux_hidden, torch.ones(n, dtype=torch.long))


def micro_batches(case: str, rank: int, target, aux: list[int], reference: bool) -> list:
    if case == "dflash-no-anchor":  # rank 1's sequences are all shorter than a block
        lens = [3, 2, 3] if rank == 1 else [12, 9]
        return [_batch(target, lens, 10 * rank + i, aux) for i in range(3)]
    if case.startswith("chunks"):  # loss chunks of 4 rows: rank 0 fills several, rank 1 one
        lens = [3, 2] if rank == 1 else [12, 9]
        return [_batch(target, lens, 10 * rank + i, aux) for i in range(2)]
    if case.startswith("no-rows"):  # rank 1's sequences hold no row a TTT step supervises
        lens = [2, 2] if rank == 1 else [12, 9]
        return [_batch(target, lens, 10 * rank + i, aux) for i in range(2)]
    if case.startswith("moe"):  # a few rows each: 8 experts, 2 per token, leave some expert empty per rank
        return [_batch(target, [4, 3], 10 * rank + i, aux) for i in range(3)]
    if case.startswith("accumulate"):
        # grad_accum 2: [a, b] is skipped (b is non-finite on rank 1), then [c, d] is the first step.
        # The reference run sees only [c, d]: the two must end with the same head.
        mbs = [_batch(target, [7, 6], 10 * rank + i, aux, poison=(i == 1 and rank == 1)) for i in range(4)]
        return mbs[2:] if reference else mbs
    raise ValueError(case)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--reference", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the ranks share this machine's cores

    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from headstart.heads import build_head
    from headstart.heads.config import HeadConfig
    from headstart.models import load_target
    from headstart.recipe_io import recipe_from_dict
    from headstart.train.module import HeadModule

    rank = int(os.environ["RANK"])
    head_type = {"dflash-no-anchor": "dflash", "moe-ddp": "deepseek_mtp", "moe-fsdp": "deepseek_mtp"}.get(
        args.case, "mtp")
    accumulate = args.case.startswith("accumulate")
    chunked = args.case.startswith(("chunks", "no-rows"))
    target = load_target(args.target, "fp32")
    extra = {"block_size": 4, "aux_layer_ids": [0, 1]} if head_type == "dflash" else {}
    recipe = recipe_from_dict({
        "seed": 3, "head": {"type": head_type, **extra},
        "train": {"lr": 1e-2, "warmup_steps": 0, "grad_accum": 2 if accumulate else 1, "grad_clip": 0.0,
                  "max_steps": 1 if accumulate else 2, "ttt_steps": 3 if chunked else 1, "max_bad_steps": 5,
                  **({"loss_chunk_tokens": 4, "batch_tokens": 32} if chunked else {})},
        "logging": {"wandb": False, "every_steps": 1},
    })
    torch.manual_seed(recipe.seed)
    head = build_head(HeadConfig(head_type=head_type, **extra), target, init_from_target=False).float()
    module = HeadModule(recipe, target, head)
    aux = list(head.config.aux_layer_ids or [])
    items = [{"batch": b} for b in micro_batches(args.case, rank, target, aux, args.reference)]
    loader = torch.utils.data.DataLoader(items, batch_size=None, collate_fn=lambda x: x)
    timeout = timedelta(seconds=TIMEOUT_S)
    if args.case.endswith("ddp"):
        strategy = DDPStrategy(process_group_backend="gloo", timeout=timeout)
    else:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timeout,
                                         process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true",
                        max_steps=recipe.train.max_steps, max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=loader)
    whole = module.full_head(here=rank == 0)  # a collective under FSDP
    if rank == 0:
        state = {k: v.detach().cpu().clone() for k, v in whole.state_dict().items()}
        torch.save({"state": state, "step": trainer.global_step, "skipped": module.skipped_steps}, args.out)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from headstart.launch import end_rank

    main()
    end_rank(0)  # as the command line does: gloo's threads may still free tensors (tests/exit_worker.py)
