"""The LightningModule: a head fitted against the frozen target (embedding, final norm, lm_head).

Manual optimisation, so that a non-finite loss skips the whole step on every rank (the ranks agree
through one all-reduce) instead of poisoning the optimizer state: AdamW, linear warmup then cosine
decay, gradient accumulation, global-norm clipping.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from headstart.config import Recipe
from headstart.errors import HeadstartError
from headstart.heads.base import DraftHead, PackedBatch
from headstart.heads.config import CHAIN_HEADS
from headstart.models.llama import LlamaForCausalLM
from headstart.nn.attention import PackedCausalAttention, packed_metadata
from headstart.nn.parallel import SINGLE, TensorParallel
from headstart.precompute.shards import from_fp8
from headstart.sizing import grad_components, loss_chunk_rows
from headstart.train.losses import LossParts, distill, distill_steps, objective
from headstart.train.ttt import check_ttt_rows, reached_rows, unroll


class TrainingDiverged(HeadstartError):
    """The loss stayed non-finite for train.max_bad_steps consecutive steps."""


def target_forward(target: LlamaForCausalLM, batch: PackedBatch, aux_layers: list[int]) -> PackedBatch:
    """Fill a token-only batch with the target's pre-norm hidden states (and aux layers), computed
    by the engine's own model over the packed sequences (online source, held-out batches)."""
    device = target.model.embed_tokens.weight.device
    ids = batch.input_ids.to(device, non_blocking=True)
    meta = packed_metadata(batch.seq_lens, device=device)
    with torch.no_grad():
        h, aux = target(ids, meta, [None] * target.num_layers, PackedCausalAttention(), capture=tuple(aux_layers))
    stacked = torch.stack([aux[j] for j in aux_layers], dim=1) if aux_layers else None
    return PackedBatch(ids, list(batch.seq_lens), h, stacked, batch.loss_mask)


def group_target_forward(target: LlamaForCausalLM, batch: PackedBatch, aux_layers: list[int],
                         tp: TensorParallel) -> PackedBatch:
    """target_forward for a rank of a tensor-parallel group whose ranks each bring their own
    micro-batch (the head is data-parallel over every rank): the ranks of a group must run each
    forward together, so the group runs one forward per member's batch, in rank order, and each
    rank keeps its own. The group's target FLOPs are those of tp unsharded forwards, as under data
    parallelism, with 1/tp of the weights per rank."""
    import torch.distributed as dist

    # Tensor collectives, not all_gather_object (a pickle and two collectives per micro-batch): the sizes,
    # then every member's token ids and sequence lengths padded to the longest. The sizes and the lengths
    # are read on the host (the forward's metadata needs them there): two small reads per micro-batch.
    device = target.model.embed_tokens.weight.device
    ids, lens = batch.input_ids.to(device), torch.tensor(list(batch.seq_lens), dtype=torch.long, device=device)
    size = torch.tensor([ids.numel(), lens.numel()], dtype=torch.long, device=device)
    sizes = [torch.empty_like(size) for _ in range(tp.size)]
    dist.all_gather(sizes, size, group=tp.group)
    sizes_host = torch.stack(sizes).cpu().tolist()
    most_ids, most_lens = max(s[0] for s in sizes_host), max(s[1] for s in sizes_host)
    got_ids = [torch.empty(most_ids, dtype=ids.dtype, device=device) for _ in range(tp.size)]
    got_lens = [torch.empty(most_lens, dtype=torch.long, device=device) for _ in range(tp.size)]
    dist.all_gather(got_ids, F.pad(ids, (0, most_ids - ids.numel())), group=tp.group)
    dist.all_gather(got_lens, F.pad(lens, (0, most_lens - lens.numel())), group=tp.group)
    lens_host = torch.stack(got_lens).cpu().tolist()  # every member's lengths in one read
    everyone = [(got_ids[r][:n], lens_host[r][:m]) for r, (n, m) in enumerate(sizes_host)]
    mine = None
    for r, (ids, lens) in enumerate(everyone):
        out = target_forward(target, PackedBatch(ids, lens, None, None, None), aux_layers)
        if r == tp.rank:
            mine = out
    assert mine is not None
    return PackedBatch(mine.input_ids, mine.seq_lens, mine.hidden, mine.aux_hidden, batch.loss_mask)


def out_of_memory(e: BaseException) -> bool:
    """A CUDA out of memory, raised as it is or wrapped by a compiler backend."""
    return isinstance(e, torch.OutOfMemoryError) or isinstance(getattr(e, "inner_exception", None),
                                                               torch.OutOfMemoryError)


class Compiled:
    """A head method run through torch.compile, or eagerly from the first call that fails to compile: the
    failure is reported once (which method, why) and training goes on. Whether it was the compiler's is
    decided by the eager run of the same call: when that fails too, the error is the computation's (a bad
    batch reaches here from dynamo as a TorchRuntimeError), so the eager error is raised and compile stays
    on. An out of memory is raised at once (an eager retry would report a compile failure that never
    happened, or run out as well). Train-time only: the engine and saving read the module's own method."""

    def __init__(self, fn: Any, what: str) -> None:
        self.eager, self.what = fn, what
        self.compiled: Any = torch.compile(fn, dynamic=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a compiler failure: fall back, say which and why
            if out_of_memory(e):
                raise
            out = self.eager(*args, **kwargs)  # raises the computation's own error, compile kept, if it fails too
            self.compiled = None
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            print(f"train.compile: {self.what} runs eagerly: it did not compile ({type(e).__name__}: {reason})",
                  file=sys.stderr)
            return out


def compile_head(head: DraftHead) -> list[str]:
    """Route the head's forward and logits through Compiled (instance attributes over the class methods);
    returns their names."""
    names = ["forward_hidden", "compute_logits"]
    for name in names:
        setattr(head, name, Compiled(getattr(head, name), f"{head.config.head_type}.{name}"))
    return names


class HeadStep(torch.nn.Module):
    """The FSDP root of a sharded head: one micro-batch's losses run inside one call of it, so FSDP gathers
    the whole head once at the call, keeps it whole through the backward, and reduce-scatters every
    gradient once when the backward ends. The head's own modules are not separate units: a unit that a
    micro-batch calls several times (each TTT step, each loss chunk, a checkpoint's recompute) made its
    collectives depend on the data, and FSDP2 trained it on other gradients than DDP's
    (tests/test_collectives.py)."""

    def __init__(self, head: DraftHead, losses: Any) -> None:
        super().__init__()
        self.head = head
        object.__setattr__(self, "losses", losses)  # HeadModule.losses: it reads the head as self.head

    def forward(self, batch: PackedBatch, with_stats: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.losses(batch, with_stats=with_stats)


def idle_block(batch: PackedBatch, block_size: int) -> PackedBatch:
    """One sequence of `block_size` zero rows with no supervised token, shaped like `batch`: what a rank
    whose micro-batch holds no dflash anchor runs, so that it takes part in every collective."""
    hidden, aux = batch.hidden, batch.aux_hidden
    return PackedBatch(torch.zeros(block_size, dtype=batch.input_ids.dtype, device=batch.input_ids.device),
                       [block_size], hidden.new_zeros(block_size, *hidden.shape[1:]),
                       aux.new_zeros(block_size, *aux.shape[1:]) if aux is not None else None,
                       torch.zeros(block_size, dtype=torch.long, device=hidden.device))


class HeadModule(L.LightningModule):
    def __init__(self, recipe: Recipe, target: LlamaForCausalLM, head: DraftHead,
                 forward_target: LlamaForCausalLM | None = None, tp: TensorParallel = SINGLE) -> None:
        """`target`: the frozen pieces the head reads (embedding, norm, lm_head: whole); `forward_target`
        computes hidden states for token-only batches (default `target`; under tensor parallelism this
        rank's shard of the whole model, `tp` its group)."""
        super().__init__()
        self.automatic_optimization = False
        self.recipe = recipe
        self.cfg = recipe.train
        # The frozen target is not registered: DDP / FSDP wrap the head alone, Lightning moves and
        # casts only the head, and checkpoints hold only the head (the target loads from its files).
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "forward_target", forward_target if forward_target is not None else target)
        self.tp = tp
        self.head = head
        check_ttt_rows(head.config.head_type, self.cfg)
        if recipe.train.compile:
            compile_head(head)
        self.fsdp_root: HeadStep | None = None  # set by configure_model under trainer.strategy fsdp
        self.aux_layers = list(head.config.aux_layer_ids or [])
        self.bad_steps = 0  # consecutive non-finite steps
        self.skipped_steps = 0
        self.consumed = 0  # micro-batches this rank has consumed (restored on resume)
        self.tokens_base = 0  # training tokens over all ranks before this process started (resume)
        self.local_tokens = 0  # tokens this rank trained on since it started
        self.tokens_seen = 0  # all ranks, as of the last sync_tokens()
        self._micro = 0
        self._t0 = time.perf_counter()
        self._tok0 = 0

    # ------------------------------------------------------------------------------------ losses

    # ------------------------------------------------------------------------------------- FSDP

    def configure_model(self) -> None:
        """Under trainer.strategy fsdp (Lightning's ModelParallelStrategy: FSDP2 over the data-parallel
        ranks) shard the head as one unit under a root that runs a whole micro-batch (HeadStep). The
        frozen target is not in this module: nothing of it is wrapped."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or self.fsdp_root is not None:
            return
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        with torch.no_grad():  # every rank starts from rank 0's head (FSDP2, unlike DDP, does not sync it)
            for t in [*self.head.parameters(), *self.head.buffers()]:
                dist.broadcast(t.data, src=0)
        if any(p.requires_grad for p in self.head.parameters(recurse=False)):
            raise ValueError(f"a {self.head.config.head_type} head owns parameters outside its submodules: FSDP "
                             "cannot shard it")
        # bf16 training on GPUs gathers bf16 weights and reduces the gradients in fp32 (FSDP2's mixed precision;
        # Lightning's autocast then computes in bf16 as before); elsewhere the weights travel as they are.
        bf16 = str(self.trainer.precision) == "bf16-mixed" and mesh.device_type == "cuda"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32 if bf16 else None, cast_forward_inputs=False)
        root = HeadStep(self.head, self.losses)
        fully_shard(root, mesh=mesh["data_parallel"], reshard_after_forward=False, mp_policy=policy)
        if hasattr(root, "set_reduce_scatter_unused_params"):  # torch >= 2.9
            # A parameter no token reached on this rank still joins the reduce-scatter (with zeros), so the
            # ranks' collectives match even if a module's use comes to depend on the data.
            root.set_reduce_scatter_unused_params(True)
        object.__setattr__(self, "fsdp_root", root)  # not a submodule: the head is registered once, as `head`

    def full_head(self, here: bool) -> DraftHead | None:
        """The head with whole weights where `here` (this rank validates or saves), else None: the head
        itself, or under FSDP an unsharded replica built from the gathered state and dropped by the
        caller after use. A collective under FSDP: every rank calls it at the same step. Without tensor
        parallelism only rank 0 reads it, and only rank 0 receives the state (on the CPU)."""
        if self.fsdp_root is None:
            return self.head if here else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        everyone = self.tp.enabled  # every rank of a tensor-parallel group validates
        state = get_model_state_dict(self.fsdp_root, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=not everyone))
        state = {k.removeprefix("head."): v for k, v in state.items()}
        if not here:
            return None
        master = next(self.head.parameters())
        with torch.device("meta"):
            replica = type(self.head)(self.head.config, self.target)
        replica = replica.to_empty(device=master.device).to(master.dtype)
        replica.load_state_dict(state)
        return replica.requires_grad_(False)

    # ------------------------------------------------------------------------------------ losses

    def losses(self, batch: PackedBatch, with_stats: bool = True, same_in_group: bool = False,
               head: DraftHead | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """The weighted loss of one micro-batch and its per-step statistics (zeros without `with_stats`).
        `same_in_group`: every rank of the tensor-parallel group holds this same batch (held-out);
        `head`: another copy of the head (the unsharded replica), default the trained one."""
        device = self.target.model.embed_tokens.weight.device
        if batch.hidden is None:
            if self.tp.enabled and not same_in_group:
                batch = group_target_forward(self.forward_target, batch, self.aux_layers, self.tp)
            else:
                batch = target_forward(self.forward_target, batch, self.aux_layers)
        # The loss mask stays on the host: the supervised rows are chosen there, without a device sync. fp8
        # shards' states arrive as stored and are dequantised here, on the device.
        hidden, aux = batch.hidden.to(device, non_blocking=True), batch.aux_hidden
        if batch.hidden_scale is not None:
            hidden = from_fp8(hidden, batch.hidden_scale.to(device, non_blocking=True))
        if aux is not None:
            aux = aux.to(device, non_blocking=True)
            if batch.aux_scale is not None:
                aux = from_fp8(aux, batch.aux_scale.to(device, non_blocking=True))
        batch = PackedBatch(batch.input_ids.to(device, non_blocking=True), batch.seq_lens, hidden, aux,
                            batch.loss_mask.cpu() if batch.loss_mask is not None else None)
        head, w = head or self.head, self.cfg.loss_weights
        kind, lk = head.config.head_type, self.cfg.loss != "kl"
        per_step: list[LossParts] = []
        chunk = self._loss_chunk(head, batch)
        if kind in CHAIN_HEADS:
            outs, _, sh = unroll(head, batch, self.cfg.ttt_steps)
            target_h = batch.hidden[sh.target_rows.to(device, non_blocking=True)]
            feat_t = head.target_features(target_h) if kind != "eagle3" and w.feature > 0 else None
            # Step j supervises the rows whose token is supervised and that have j predecessors (ttt.unroll).
            supervised, pos = sh.token_mask.cpu() > 0, packed_metadata(sh.seq_lens).positions
            rows = [torch.nonzero(supervised & (pos >= j)).flatten() for j in range(len(outs))]
            # train.ttt_rows: reached weighs the rows by the greedy chain's reach (device masks); held-out
            # statistics keep every row.
            reach = reached_rows(head, outs, sh, chunk) if self.cfg.ttt_rows == "reached" and head.training else None
            per_step = distill_steps(head, outs, target_h, rows, feat_t, chunk, w.kl > 0, with_stats, lk,
                                     grad_components(self.cfg.loss), row_weights=reach)
        elif kind == "medusa":
            states, sh = head.train_forward(batch)  # (N, k, d)
            mask = sh.token_mask.cpu() > 0  # host: the rows are chosen without a sync
            for j in range(states.shape[1]):
                target_h = batch.hidden[sh.target_rows[:, j].to(device, non_blocking=True)]
                rows = torch.nonzero(mask[:, j]).flatten()
                per_step.append(distill(head, states[:, j], target_h, rows, None, chunk, with_stats=with_stats, lk=lk))
        elif kind == "dflash":
            return self._block_losses(head, batch, with_stats, same_in_group)
        else:  # draft_lm: KL to the target's next-token distribution
            h, sh = head.train_forward(batch)
            rows = torch.nonzero(sh.token_mask.cpu() > 0).flatten()
            target_h = batch.hidden[sh.target_rows.to(device, non_blocking=True)]
            per_step.append(distill(head, h, target_h, rows, None, chunk, with_stats=with_stats, lk=lk))
        d = head.config.hidden_size
        total = torch.zeros((), device=device)
        for j, part in enumerate(per_step):
            n = max(part.rows, 1)
            step_loss = w.kl * self._objective(part) + w.feature * part.feature / (n * d)
            weight = self.cfg.ttt_decay ** j if kind in CHAIN_HEADS else 1.0
            total = total + weight * step_loss
        stats: dict[str, Any] = {"rows": [p.rows for p in per_step], "tokens": int(batch.input_ids.numel())}
        if with_stats:  # host syncs: only when asked
            stats.update(correct=[float(p.correct) for p in per_step], accept=[float(p.accept) for p in per_step],
                         mass=[float(p.mass) for p in per_step],
                         kl=[float(p.kl.detach()) / max(p.rows, 1) for p in per_step])
        return total, stats

    def _objective(self, part: LossParts) -> torch.Tensor:
        """A step's distribution loss per supervised row (train.loss: kl or an LK loss)."""
        loss = "lk_lambda" if self.cfg.loss == "lk" else self.cfg.loss
        return objective(part, loss, self.cfg.lk_kl_scale, self.cfg.lk_kl_decay)

    def _loss_chunk(self, head: DraftHead, batch: PackedBatch) -> int:
        """Rows per loss chunk on this batch's device; the TTT steps of a chain head share each chunk."""
        steps = self.cfg.ttt_steps if head.config.head_type in CHAIN_HEADS else 1
        vocab = head.config.draft_vocab_size or head.target.vocab_size
        return loss_chunk_rows(self.cfg.loss_chunk_tokens, vocab, steps, batch.hidden.device.type,
                               int(batch.input_ids.numel()), self.cfg.loss != "kl", head.target.vocab_size)

    def _block_losses(self, head: DraftHead, batch: PackedBatch, with_stats: bool,
                      heldout: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        """DFlash's block objective, as speculators trains it (models/dflash: fixed-exp-decay):
        forward KL to the target's distribution at every supervised draft slot, slot i weighted
        exp(-(i - 1) / gamma) (gamma = block_decay_gamma), the anchor slot not at all, the weighted sum
        divided by the number of supervised slots. Per-slot statistics are the "steps" of the log.
        Anchors are drawn from a generator seeded by the recipe, the rank and the micro-batch count,
        so a resumed run draws what the uninterrupted one would; held-out batches take evenly spread
        anchors (no draw): val_loss is comparable across validations."""
        device = batch.hidden.device
        g = torch.Generator().manual_seed(self.recipe.seed * 1_000_003 + self.global_rank * 7919 + self.consumed)
        from headstart.heads.dflash import AnchoredBlocks, choose_anchors

        blocks = choose_anchors(batch, head.block_size, self.recipe.head.max_anchors, g, heldout=heldout)
        tokens = int(batch.input_ids.numel())
        if blocks is None:
            # No sequence holds a whole block. The head still runs, over one unsupervised block of zeros:
            # under FSDP every rank must gather the same units in the same order, whatever its data.
            batch = idle_block(batch, head.block_size)
            blocks = AnchoredBlocks(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), head.block_size)
        h = head.train_blocks(batch, blocks)
        chunk = self._loss_chunk(head, batch)
        bs, rows = head.block_size, blocks.rows  # host indices: the supervised slots are chosen without a sync
        mask = batch.loss_mask.cpu()[rows] > 0 if batch.loss_mask is not None else torch.ones_like(rows).bool()
        slot = torch.arange(rows.numel()) % bs
        per_step = []
        # Slot i (row a + i) is supervised by the target's prediction at a + i - 1.
        target_h = batch.hidden[(rows - 1).to(device, non_blocking=True)]
        for i in range(1, bs):
            sel = torch.nonzero(mask & (slot == i)).flatten()
            per_step.append(distill(head, h, target_h, sel, None, chunk, with_stats=with_stats,
                                    lk=self.cfg.loss != "kl"))
        n = max(sum(p.rows for p in per_step), 1)
        gamma = self.cfg.block_decay_gamma
        # slot i's loss per row, times its rows (kl: its summed KL), over every supervised slot
        total = sum(math.exp(-(i - 1) / gamma) * p.rows * self._objective(p)
                    for i, p in enumerate(per_step, start=1)) / n
        stats: dict[str, Any] = {"rows": [p.rows for p in per_step], "tokens": tokens}
        if with_stats:
            stats.update(correct=[float(p.correct) for p in per_step], accept=[float(p.accept) for p in per_step],
                         mass=[float(p.mass) for p in per_step],
                         kl=[float(p.kl.detach()) / max(p.rows, 1) for p in per_step])
        return total, stats

    # ---------------------------------------------------------------------------------- training

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Left as it comes: `losses` copies what runs on the device without waiting (from pinned memory)
        and keeps the loss mask on the host, where the supervised rows are chosen without a sync."""
        return batch

    def training_step(self, item: dict[str, Any], batch_idx: int) -> None:
        opt = self.optimizers()
        sched = self.lr_schedulers()
        # Statistics only on the steps that are logged (they cost ~10% of a step).
        logged = (self.global_step + 1) % self.recipe.logging.every_steps == 0
        # Under FSDP through the root: one gather of the head per micro-batch, one reduce when its backward ends.
        run = self.fsdp_root if self.fsdp_root is not None else self.losses
        loss, stats = run(item["batch"], with_stats=logged)
        self.consumed += 1
        self.local_tokens += stats["tokens"]
        # Every rank must take the same decision: one scalar all-reduce per micro-batch, and the step's one
        # host sync (reading its result); everything else the host reads waits for a logged step.
        bad = (~torch.isfinite(loss.detach())).float()
        if self.trainer.strategy.reduce(bad, reduce_op="max").item() > 0:
            self.bad_steps += 1
            self.skipped_steps += 1
            self._micro = 0
            opt.zero_grad(set_to_none=True)
            self.print(f"non-finite loss at step {self.global_step}: step skipped "
                       f"({self.bad_steps} in a row, {self.skipped_steps} in all)", file=sys.stderr)
            if self.bad_steps >= self.cfg.max_bad_steps:
                raise TrainingDiverged(
                    f"the loss was non-finite for {self.bad_steps} consecutive steps (step {self.global_step}); "
                    "lower train.lr, check the data, or use a higher-precision trainer.precision")
            return
        self.bad_steps = 0
        last = self._micro + 1 >= self.cfg.grad_accum
        strategy = self.trainer.strategy
        # DDP: gradients are all-reduced once per optimizer step, not once per micro-batch. FSDP reduce-
        # scatters after every micro-batch instead: its unsynced gradients would be whole (unsharded) and
        # kept outside .grad, where a skipped micro-batch's zero_grad cannot clear them and they would
        # leak into the next step; sharded, they are 1/ranks of the memory (what `plan` counts).
        no_sync = not last and self.fsdp_root is None and hasattr(strategy, "block_backward_sync")
        sync = strategy.block_backward_sync() if no_sync else contextlib.nullcontext()
        with sync:
            self.manual_backward(loss / self.cfg.grad_accum)
        self._micro += 1
        if not last:
            return
        self._micro = 0
        if self.cfg.grad_clip > 0:
            self.clip_gradients(opt, gradient_clip_val=self.cfg.grad_clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        lr = sched.get_last_lr()[0]
        self.last_train = {"step": self.global_step, "loss": loss.detach(), "lr": lr}  # read by log_row
        if logged:
            self.log("loss", loss.detach(), prog_bar=True, rank_zero_only=True)
            self.log("lr", lr, rank_zero_only=True)
            for j, (r, c) in enumerate(zip(stats["rows"], stats["correct"])):
                if r:
                    self.log(f"train_top1_{j}", c / r, rank_zero_only=True)

    def sync_tokens(self) -> int:
        """Training tokens over all ranks (a collective: every rank calls it at the same step)."""
        local = torch.tensor(float(self.local_tokens), device=self.device)
        self.tokens_seen = self.tokens_base + int(self.trainer.strategy.reduce(local, reduce_op="sum"))
        return self.tokens_seen

    def log_row(self) -> dict[str, Any]:
        """The learning-curve row of this step (a collective, see sync_tokens)."""
        tokens = self.sync_tokens()
        now = time.perf_counter()
        rate = (tokens - self._tok0) / max(now - self._t0, 1e-9)
        self._t0, self._tok0 = now, tokens
        last = dict(getattr(self, "last_train", {}))
        if torch.is_tensor(last.get("loss")):
            last["loss"] = float(last["loss"])  # the host reads the loss here, once per logging interval
        return {**last, "step": self.global_step, "tokens": tokens, "tok_s": rate}

    @torch.no_grad()
    def heldout_metrics(self, batches: list[PackedBatch], head: DraftHead | None = None) -> dict[str, Any]:
        """val_loss and per-step top-1 / expected acceptance on held-out micro-batches."""
        head = head or self.head
        was = head.training
        head.eval()
        total, n, sums = 0.0, 0, {}
        for b in batches:
            loss, st = self.losses(b, same_in_group=True, head=head)
            total += float(loss)
            n += 1
            for key in ("rows", "correct", "accept", "mass"):
                sums[key] = st[key] if key not in sums else [a + x for a, x in zip(sums[key], st[key])]
        head.train(was)
        if not n:
            return {}
        per_row = {key: [c / max(r, 1) for c, r in zip(sums[key], sums["rows"])]
                   for key in ("correct", "accept", "mass")}
        return {"val_loss": total / n, "top1_per_step": per_row["correct"],
                "sampled_accept_per_step": per_row["accept"], "draft_vocab_mass": per_row["mass"][0]}

    # ------------------------------------------------------------------------------ optimisation

    def configure_optimizers(self) -> dict[str, Any]:
        params = self.head.trainable_parameters()
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]  # norms and biases
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=self.cfg.lr, betas=(0.9, 0.95))
        cfg = self.cfg

        def factor(step: int) -> float:
            if step < cfg.warmup_steps:
                return (step + 1) / (cfg.warmup_steps + 1)
            span = max(cfg.max_steps - cfg.warmup_steps, 1)
            progress = min((step - cfg.warmup_steps) / span, 1.0)
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---------------------------------------------------------------------------------- resume

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # tokens_seen was synced by the caller (a collective cannot run inside the save).
        checkpoint["headstart"] = {"consumed": self.consumed, "tokens_seen": self.tokens_seen,
                                   "skipped_steps": self.skipped_steps,
                                   "head_type": self.head.config.head_type}  # checked before a resume loads it

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        info = checkpoint.get("headstart", {})
        self.consumed = info.get("consumed", 0)
        self.tokens_seen = self.tokens_base = self._tok0 = info.get("tokens_seen", 0)
        self.skipped_steps = info.get("skipped_steps", 0)
