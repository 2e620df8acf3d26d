"""`headstart train RECIPE [--resume]`: fit the recipe's head and write, under output_dir,

    checkpoints/last.ckpt      Lightning checkpoint (head, optimizer, schedule, data position)
    head-final/, head-best/    native head checkpoints (best by engine-measured tau)
    metrics.json               the last validation (val_loss, top1_per_step, tau, alpha, ...)
    metrics.csv                the learning curve (train rows every logging.every_steps, val rows)
    train.json                 what this run is (fingerprints), checked by --resume
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar

from headstart.config import Recipe
from headstart.console import status
from headstart.errors import ConfigError, DataError, HeadstartError, OutputError
from headstart.fileio import atomic_write_text, exclusive_lock, remove_path, swap_into_place
from headstart.heads import (
    build_head,
    copies_target,
    head_config_from_recipe,
    init_copied_layers,
    save_head,
    start_from_head,
)
from headstart.heads.base import TargetParts
from headstart.nn.parallel import SINGLE, TensorParallel
from headstart.train.data import (
    ArrowSequences,
    PackedStream,
    ShardSequences,
    TokenSequences,
    TrainData,
    check_training_split,
    install_draft_vocab,
    pack,
)
from headstart.train.module import HeadModule
from headstart.train.outputs import (
    FORMAT,
    CurveWriter,
    check_checkpoint_head,
    check_output_dir,
    check_resume,
    flat_recipe,
    lock_path,
    remove_crash_leftovers,
    resumed_init_sha,
)
from headstart.train.ttt import check_ttt_rows
from headstart.train.validate import engine_acceptance, heldout_prompts

# Keys that may change on --resume without changing what is being trained.
RESUMABLE_CHANGES = ("train.max_steps", "train.epochs", "train.val_every_steps", "train.val_prompts",
                     "train.val_max_tokens", "train.val_loss_batches", "train.ckpt_every_steps", "train.num_workers",
                     "logging", "trainer", "name", "precompute", "regenerate", "output_dir", "target.config",
                     "head.init_from")  # where the initial head was: its sha256 is the identity


def run_dir(recipe: Recipe) -> Path:
    return Path(recipe.output_dir)


def _identity(recipe: Recipe, target_fp: str, data_fp: str, resolved: dict[str, Any]) -> dict[str, Any]:
    """What a resume must match. `resolved` adds what the recipe leaves open (auto dtype/precision)
    and the world size, which fixes how micro-batches are split across ranks."""
    flat = {k: v for k, v in flat_recipe(recipe.to_dict()).items()
            if not any(k == p or k.startswith(p + ".") for p in RESUMABLE_CHANGES)}
    flat.update(resolved)
    return {"format": FORMAT, "target_fingerprint": target_fp, "data_fingerprint": data_fp, "recipe": flat}


class Outputs(L.Callback):
    """Everything that happens on optimizer-step boundaries: the curve row (rank 0), the checkpoint
    (all ranks), engine validation every train.val_every_steps and at the end (rank 0), head-best /
    head-final, metrics.json. Acting only when the step has just advanced keeps a checkpoint from
    landing between the micro-batches of an accumulation, and a resumed step from validating twice."""

    def __init__(self, run: TrainRun, curve: CurveWriter | None) -> None:
        self.run, self.curve = run, curve
        self.best_tau = run.best_tau
        self.seen_step = 0
        self.last_val_step = -1
        self.last_ckpt_step = -1
        self.stopped_early = False  # by the time box (--minutes): no validation, no head-final, resumable

    def on_train_start(self, trainer: L.Trainer, module: HeadModule) -> None:
        self.seen_step = self.last_ckpt_step = trainer.global_step
        if self.curve:
            self.curve.start(trainer.global_step)
        if trainer.global_step and trainer.is_global_zero:
            status(f"train: resumed at step {trainer.global_step} ({module.consumed} micro-batches consumed)")

    def on_train_batch_end(self, trainer: L.Trainer, module: HeadModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self.seen_step:  # mid-accumulation, or a skipped (non-finite) step
            return
        self.seen_step = step
        cfg = self.run.recipe
        if step % cfg.logging.every_steps == 0:
            row = module.log_row()  # all ranks: it reduces the token count
            module.log("tok_s", row["tok_s"], prog_bar=True, rank_zero_only=True)
            if trainer.is_global_zero and self.curve:
                self.curve.add({"kind": "train", **row})
        if step % cfg.train.ckpt_every_steps == 0:
            self.checkpoint(trainer)
        ve = cfg.train.val_every_steps
        if ve and step % ve == 0 and step < trainer.max_steps:
            module.sync_tokens()
            self.validate(trainer, module)
        if self.run.deadline is not None and step < trainer.max_steps and self._time_up(trainer):
            if self.last_ckpt_step != step or self.last_val_step == step:  # a checkpoint before this step's
                self.checkpoint(trainer)  # validation lacks its best tau: --resume would start from an older one
            self.stopped_early = trainer.should_stop = True

    def _time_up(self, trainer: L.Trainer) -> bool:
        """Rank 0's clock decides for every rank: ranks that stopped on different steps would wait on each
        other's collectives for ever."""
        return bool(trainer.strategy.broadcast(time.monotonic() >= self.run.deadline, src=0))

    def on_train_end(self, trainer: L.Trainer, module: HeadModule) -> None:
        module.log_row()
        if self.stopped_early:
            if trainer.is_global_zero:
                status(f"train: stopped at step {trainer.global_step} of {trainer.max_steps} (--minutes); "
                       f"{run_dir(self.run.recipe) / 'checkpoints' / 'last.ckpt'} holds it: rerun with --resume to "
                       "continue")
            return
        if trainer.global_step != self.last_ckpt_step:
            self.checkpoint(trainer)
        if trainer.global_step != self.last_val_step:
            self.validate(trainer, module)
        head = module.full_head(here=trainer.is_global_zero)  # every rank: a collective under FSDP
        if trainer.is_global_zero:
            save_head(head, run_dir(self.run.recipe) / "head-final", overwrite=True)

    def checkpoint(self, trainer: L.Trainer) -> None:
        """checkpoints/last.ckpt (a file; under FSDP a directory of every rank's shards plus meta.pt),
        written under a temporary name and swapped in: a kill mid-write keeps the previous checkpoint."""
        self.last_ckpt_step = trainer.global_step
        trainer.lightning_module.sync_tokens()
        d = run_dir(self.run.recipe) / "checkpoints"
        tmp = d / f".last.ckpt.tmp-{os.getpid()}"  # under FSDP every rank writes to rank 0's name
        try:
            trainer.save_checkpoint(str(tmp), weights_only=False)  # every rank; --resume needs the optimiser too
            if trainer.is_global_zero:
                swap_into_place(tmp, d / "last.ckpt")
        except OSError as e:
            if trainer.is_global_zero:
                remove_path(tmp)
            raise OutputError(f"{d / 'last.ckpt'}: the checkpoint cannot be written ({e.strerror or e}); the "
                              "previous one is kept: free space, then rerun with --resume") from None
        trainer.strategy.barrier("checkpoint")

    def validate(self, trainer: L.Trainer, module: HeadModule) -> None:
        self.last_val_step = trainer.global_step
        # Under TP the ranks of a group validate together; a collective under FSDP (every rank calls it).
        head = module.full_head(here=trainer.is_global_zero or self.run.tp.enabled)
        if head is not None:
            metrics = self.run.validate(module, head, trainer.precision_plugin.forward_context)
        if trainer.is_global_zero:
            metrics.update(step=trainer.global_step, tokens=module.tokens_seen, skipped_steps=module.skipped_steps)
            scalars = {k: metrics[k] for k in ("val_loss", "tau", "alpha") if metrics.get(k) is not None}
            scalars.update({f"val_top1_{j}": x for j, x in enumerate(metrics.get("top1_per_step", []))})
            for lg in trainer.loggers:
                lg.log_metrics(scalars, step=trainer.global_step)
            out = run_dir(self.run.recipe)
            atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2))
            if self.curve:
                self.curve.add({"kind": "val", **metrics})
            tau = metrics.get("tau")
            if tau is not None and (self.best_tau is None or tau > self.best_tau):
                self.best_tau = tau
                save_head(head, out / "head-best", overwrite=True)
                atomic_write_text(out / "head-best" / "metrics.json", json.dumps(metrics, indent=2))
            line = (f"validation @ step {trainer.global_step}: tau {_f(tau)}  alpha {_f(metrics.get('alpha'))}  "
                    f"val_loss {_f(metrics.get('val_loss'))}  top1/step "
                    f"{[round(x, 3) for x in metrics.get('top1_per_step', [])]}")
            module.print(line, file=sys.stderr)  # through the progress bar, so the bar is not torn
        trainer.strategy.barrier("validation")

    def state_dict(self) -> dict[str, Any]:
        return {"best_tau": self.best_tau}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_tau = state.get("best_tau")


class StepProgressBar(RichProgressBar):
    """A rich bar over optimizer steps x micro-batches (the stream is endless, so Lightning alone
    would show no total and no ETA); loss and tokens/s ride along as logged metrics."""

    @property
    def total_train_batches(self) -> int | float:
        accum = self.trainer.lightning_module.cfg.grad_accum
        return self.trainer.max_steps * accum if self.trainer.max_steps > 0 else super().total_train_batches


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def global_rank(devices: int) -> int:
    """This process's rank before Lightning has set up: torchrun sets RANK, SLURM sets SLURM_PROCID,
    Lightning's own launcher sets NODE_RANK and LOCAL_RANK."""
    env = os.environ
    for key in ("RANK", "SLURM_PROCID"):
        if key in env:
            return int(env[key])
    return int(env.get("NODE_RANK", "0")) * devices + int(env.get("LOCAL_RANK", "0"))


class TrainRun:
    """Everything one `headstart train` builds: target, head, data, module, trainer."""

    def __init__(self, recipe: Recipe, *, resume: bool = False, progress: bool = True,
                 deadline: float | None = None) -> None:
        from headstart.assets import resolve_model
        from headstart.data.dataset import build_dataset
        from headstart.hardware import describe, resolve_dtype, resolve_precision
        from headstart.models import load_target

        self.recipe, self.progress = recipe, progress
        self.deadline = deadline  # time.monotonic() after which the run checkpoints and stops (--minutes)
        cfg, tr = recipe.train, recipe.trainer
        self.rank = global_rank(tr.devices)
        self.world = tr.devices * tr.num_nodes
        out = run_dir(recipe)
        device = train_device(tr)
        use_cuda = device == "cuda"
        self.precision = resolve_precision(tr.precision, tr.accelerator)
        self.dtype = resolve_dtype(recipe.target.dtype, device)
        if self.precision.startswith("32") and self.dtype != "fp32":
            raise ConfigError(f"trainer.precision {self.precision} computes in fp32 but target.dtype is {self.dtype}; "
                              "set target.dtype: fp32 (or auto) or trainer.precision: bf16-mixed")
        check_ttt_rows(recipe.head.type, cfg)  # before the target loads
        if self.rank == 0:
            status(f"train: target dtype {self.dtype}, precision {self.precision} ({describe(device)})")
        model_dir = resolve_model(recipe.target.model)
        # Straight onto this rank's GPU, one tensor at a time: a rank never holds the whole target in host
        # memory (8 ranks x a 16 GB target used to be 128 GB of host memory per node before the move).
        load_on = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu"
        self.tp = join_tensor_parallel(recipe.engine.tensor_parallel, tr.devices, tr.num_nodes, use_cuda)
        if self.tp.enabled:
            # This rank's shard of the whole target runs the forwards (online hidden states, engine
            # validation, with its group); the head trains against whole copies of the embedding,
            # final norm and lm_head, plus the layers its init copies: a partial target.
            self.engine_target = load_target(model_dir, self.dtype, device=load_on, tp=self.tp)
            self.target = load_target(model_dir, self.dtype, device=load_on, layers=init_copied_layers(recipe.head))
            if copies_target(recipe.head):
                from headstart.heads.base import target_state_rms

                self.target.state_rms = target_state_rms(self.engine_target)  # the group's forward
        elif cfg.source == "shards" and self.rank != 0:
            # From shards no forward runs here, and only rank 0 validates: the other ranks hold what the
            # head reads (embedding, final norm, lm_head), not the whole target. Their head starts from
            # rank 0's (DDP and the FSDP set-up broadcast it).
            self.target = self.engine_target = load_target(model_dir, self.dtype, device=load_on, layers=[])
        else:
            self.target = self.engine_target = load_target(model_dir, self.dtype, device=load_on)
        from headstart.inference.backends import check_backend

        # Validation builds its engine at the first validation: refuse a backend it cannot run now.
        check_backend(recipe.engine.backend, torch.device(device), self.engine_target)
        built = build_dataset(recipe.data, str(model_dir), progress=progress and self.rank == 0)
        self.tokenizer = built.tokenizer
        if len(built.train) == 0:
            raise DataError(f"{recipe.data.source}: the training split is empty (data.limit={recipe.data.limit}, "
                            f"heldout_fraction={recipe.data.heldout_fraction}); nothing to train on")
        if (cfg.max_sequences or 0) > len(built.train):  # before the draft vocabulary counts them
            raise DataError(f"train.max_sequences={cfg.max_sequences} but the training split holds "
                            f"{len(built.train)} sequences; lower it or set it to null (all)")
        from_rank0 = self.target.partial and not self.tp.enabled  # cannot run its init: rank 0's is broadcast
        # The head's random parameters (those its init does not copy) come from recipe.seed: a rerun, a
        # resume's rebuild and every rank start from the same head.
        torch.manual_seed(recipe.seed)
        self.head = build_head(head_config_from_recipe(recipe.head), self.target,
                               init_from_target=copies_target(recipe.head) and not from_rank0)
        if cfg.loss_weights.kl == 0 and self.head.config.head_type in ("eagle3", "medusa", "draft_lm", "dflash"):
            raise ConfigError(f"train.loss_weights.kl=0: a {self.head.config.head_type} head learns from the KL "
                              "term only (it has no feature loss), so nothing would be trained")
        if self.precision != "bf16-true":
            self.head.float()  # fp32 master weights; the frozen target stays in its compute dtype
        # head.init_from: loaded into the fp32 master weights (not rounded to the target's dtype). A resume
        # reads neither it nor its vocabulary (the checkpoint holds both), only its recorded sha256.
        init_sha = resumed_init_sha(out, recipe.head.init_from) if resume else self._start_from(recipe.head.init_from)
        if self.head.config.draft_vocab_size and not (resume and init_sha):
            install_draft_vocab(self.head, self.target.config.vocab_size, built.train, cfg.max_sequences,
                                keep=init_sha is not None, announce=self.rank == 0 and not resume)
        aux = list(self.head.config.aux_layer_ids or [])
        if cfg.source == "shards":
            from headstart.precompute.run import output_dir as precompute_dir

            shards = Path(cfg.shards_dir) if cfg.shards_dir else precompute_dir(recipe)
            source: Any = ShardSequences(shards, expect_target=self.target.fingerprint(), expect_aux=aux, keep_fp8=True)
            check_training_split(shards, source, built, recipe.data)
        else:
            source = ArrowSequences(built.train)
        self.stream = PackedStream(source, cfg.batch_tokens, recipe.seed, self.rank % self.world, self.world,
                                   cfg.epochs, cfg.max_sequences)
        held = TokenSequences.from_dataset(built.heldout)
        self.heldout_batches = [held.load(b) for b in pack(list(range(len(held.ids))), held.lengths,
                                                            max(cfg.batch_tokens, max(held.lengths, default=1)))
                                if sum(held.lengths[i] for i in b) >= 3][:cfg.val_loss_batches]
        self.prompts = heldout_prompts(held.ids, held.masks, cfg.val_prompts)
        if len(self.prompts) < cfg.val_prompts and self.rank == 0:
            status(f"train: train.val_prompts={cfg.val_prompts} but the held-out split has {len(self.prompts)} "
                  f"prompts; validating on {len(self.prompts)}")
        self.identity = _identity(recipe, self.target.fingerprint(), built.fingerprint,
                                  {"resolved.dtype": self.dtype, "resolved.precision": self.precision,
                                   "resolved.world_size": self.world,
                                   "resolved.checkpoint": "sharded" if tr.strategy == "fsdp" else "file",
                                   **({"resolved.init_from_sha256": init_sha} if init_sha else {})})
        self.ckpt = check_resume(out, self.identity, resume, self.rank)
        if self.ckpt is not None:
            check_checkpoint_head(self.ckpt, self.head)
        self.best_tau = None
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / "train.json", json.dumps(self.identity, indent=2, default=str))
        self.curve = CurveWriter(out / "metrics.csv") if self.rank == 0 else None
        self.module = HeadModule(recipe, self.target, self.head, self.engine_target, self.tp)
        self.engine_parts = TargetParts(self.engine_target)  # one object: it caches restricted lm_head rows
        self.device = device

    def _start_from(self, path: str | None) -> str | None:
        """head.init_from: the trained head's weights and draft vocabulary replace the new head's."""
        if not path:
            return None
        sha, saved_for = start_from_head(self.head, path, self.target)
        if self.rank == 0:
            other = ("" if saved_for == self.target.fingerprint() else
                     f" (saved for another target of this shape, {saved_for[:12]}…: its weights are a starting point)")
            status(f"train: the head starts from {path}{other}, its draft vocabulary kept")
        return sha

    @torch.no_grad()
    def validate(self, module: HeadModule, head: Any, autocast: Any = contextlib.nullcontext) -> dict[str, Any]:
        """Held-out loss metrics under the training step's autocast (`autocast()`: the precision
        plugin's forward context), then the engine's acceptance outside it, exactly as `headstart
        eval` runs: under autocast every Linear falls back to torch's matmul, the row-invariant
        kernels are skipped and head-best would be chosen on numbers eval does not reproduce."""
        with autocast():
            metrics = module.heldout_metrics(self.heldout_batches, head)
        # Under tensor parallelism every rank of the group runs the engine on its shard, in step.
        reading = head.reading(self.engine_parts) if self.tp.enabled else contextlib.nullcontext()
        with reading:
            acc = engine_acceptance(self.engine_target, head, self.prompts, k=self.recipe.head.k,
                                    max_tokens=self.recipe.train.val_max_tokens, tokenizer=self.tokenizer,
                                    seed=self.recipe.seed, backend=self.recipe.engine.backend)
        metrics.update({key: acc.get(key) for key in ("tau", "alpha", "accept_rate_per_pos", "cond_accept_per_pos",
                                                      "accept_histogram", "steps", "k", "prompts")})
        return metrics

    def trainer(self) -> L.Trainer:
        from lightning.pytorch.loggers import CSVLogger

        recipe, tr = self.recipe, self.recipe.trainer
        out = run_dir(recipe)
        loggers: list[Any] = [CSVLogger(str(out), name="lightning_logs")]
        if recipe.logging.wandb:
            from lightning.pytorch.loggers import WandbLogger

            offline = not os.environ.get("WANDB_API_KEY")
            loggers.append(WandbLogger(project=recipe.logging.project, name=recipe.name, save_dir=str(out),
                                       offline=offline))
            if offline and self.rank == 0:
                status("train: no WANDB_API_KEY: Weights & Biases logs offline (wandb sync later)")
        strategy: Any = tr.strategy
        if strategy == "auto" and self.world > 1:
            strategy = "ddp"
        if strategy == "ddp" and self.device == "cpu":
            from lightning.pytorch.strategies import DDPStrategy

            strategy = DDPStrategy(process_group_backend="gloo")
        elif strategy == "fsdp":
            # FSDP2 (fully_shard) through Lightning's ModelParallelStrategy: the head sharded over every
            # rank (HeadModule.configure_model), checkpoints as one directory of every rank's shards.
            from lightning.pytorch.strategies import ModelParallelStrategy

            strategy = ModelParallelStrategy(data_parallel_size=self.world, tensor_parallel_size=1,
                                             save_distributed_checkpoint=True,
                                             process_group_backend="gloo" if self.device == "cpu" else None)
        callbacks: list[Any] = [Outputs(self, self.curve)]
        if self.progress:
            callbacks.append(StepProgressBar(leave=True))
        return L.Trainer(
            accelerator="gpu" if self.device == "cuda" else "cpu", devices=tr.devices, num_nodes=tr.num_nodes,
            strategy=strategy, precision=self.precision, max_steps=recipe.train.max_steps, max_epochs=1,
            logger=loggers, callbacks=callbacks, enable_progress_bar=self.progress, log_every_n_steps=1,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
            enable_checkpointing=False, default_root_dir=str(out),
        )

    def fit(self) -> dict[str, Any]:
        data = TrainData(self.stream, self.recipe.train.num_workers)
        trainer = self.trainer()
        trainer.fit(self.module, datamodule=data, ckpt_path=str(self.ckpt) if self.ckpt else None)
        out = run_dir(self.recipe)
        metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
        return metrics


def train_device(tr: Any) -> str:
    """"cuda" or "cpu" for the trainer section; a GPU asked for but not visible is an error."""
    use_cuda = tr.accelerator in ("gpu", "cuda") or (tr.accelerator == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={tr.accelerator} but no CUDA GPU is visible here; use "
                          "trainer.accelerator: cpu (or auto)")
    return "cuda" if use_cuda else "cpu"


def join_tensor_parallel(size: int, devices: int, num_nodes: int, use_cuda: bool) -> TensorParallel:
    """This rank's tensor-parallel group (SINGLE for size 1). The process group must exist before the
    target loads (each rank reads its shard), so the ranks come from an external launcher."""
    from headstart.nn.parallel import init_tensor_parallel

    if size == 1:
        return SINGLE
    from headstart.launch import launch_env

    world = devices * num_nodes
    launched = launch_env()[0] if "WORLD_SIZE" in os.environ else 0
    if world % size:
        raise ConfigError(f"engine.tensor_parallel {size} does not divide trainer.devices x trainer.num_nodes = "
                          f"{world}: set trainer.devices to a multiple of {size}")
    if not launched:
        raise ConfigError(f"engine.tensor_parallel {size}: train shards the target over ranks that torchrun (or "
                          "SLURM + torchrun) launched, and finds no WORLD_SIZE in the environment; launch with "
                          f"torchrun --nnodes {num_nodes} --nproc-per-node {devices} -m headstart.cli train RECIPE")
    if launched != world:
        raise ConfigError(f"engine.tensor_parallel {size}: torchrun launched WORLD_SIZE={launched} ranks but "
                          f"trainer.devices x trainer.num_nodes = {devices} x {num_nodes} = {world}; set them to "
                          f"match (e.g. --set trainer.devices={launched // max(num_nodes, 1)})")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        tp, _, _ = init_tensor_parallel(size, backend="nccl" if use_cuda else "gloo")
    except ValueError as e:
        raise ConfigError(f"engine.tensor_parallel: {e}") from None
    return tp


def run_train(recipe: Recipe, *, resume: bool = False, progress: bool = True,
              minutes: float | None = None) -> dict[str, Any]:
    """Train the recipe's head; returns the last validation's metrics. The output_dir is checked
    before the target loads, and held by one run at a time (a second one refuses at once). `minutes`
    time-boxes the run from this call: at the first optimizer step past it, a checkpoint and a clean
    stop (no validation, no head-final) that --resume continues as if never stopped."""
    if minutes is not None and not minutes > 0:
        raise ConfigError(f"--minutes {minutes}: must be > 0")
    deadline = time.monotonic() + minutes * 60 if minutes is not None else None
    # Ranks torchrun (or a hand-set environment) started all come, or are named; a tensor-parallel run
    # meets when it joins its groups (join_tensor_parallel, after its own checks).
    from headstart.launch import launch_env, rendezvous
    from headstart.plan import check_recipe_fits

    launch_env()  # a bad WORLD_SIZE / RANK / LOCAL_RANK is named before anything loads
    if "RANK" in os.environ and recipe.engine.tensor_parallel == 1:
        rendezvous()
    plan = check_recipe_fits(recipe, ("train", "validation"), torch.device(train_device(recipe.trainer)))  # first
    out = check_output_dir(recipe, resume)
    rank = global_rank(recipe.trainer.devices)
    if rank == 0:  # before any training: a head no engine of the target loads is better known now
        for line in plan.serving:
            print(f"train: the head serves on {line}")
    with exclusive_lock(lock_path(out, rank), what=f"train into {out}"):
        if rank == 0:
            remove_crash_leftovers(out)
        return _train(recipe, resume, progress, deadline)


def _train(recipe: Recipe, resume: bool, progress: bool, deadline: float | None) -> dict[str, Any]:
    run = TrainRun(recipe, resume=resume, progress=progress, deadline=deadline)
    try:
        metrics = run.fit()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Every rank leaves together and closes the group (the command line then ends each rank without
            # the interpreter's teardown, where the group's threads could still abort it: launch.end_rank).
            dist.barrier()
            dist.destroy_process_group()
        return metrics
    except HeadstartError:
        raise
    except torch.OutOfMemoryError as e:
        raise HeadstartError(f"out of memory ({str(e).splitlines()[0]}); lower train.batch_tokens") from None

