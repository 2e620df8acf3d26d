"""`headstart precompute`: run the target over a recipe's tokenised data and store hidden states.

Plan: the split's sequences, in dataset order, are cut into shards of >= shard_tokens tokens
(deterministic). Shard i is written by rank i % world_size; every shard is computed in fixed
batches of <= batch_tokens tokens, so its bytes do not depend on who computed it or when. A shard
exists under its final name only when complete, so `--resume` simply skips finished shards; the
manifest is rebuilt from the shard files at the end (by rank 0 after a barrier).

`run.json`, written before any shard, holds the fingerprints (target, dataset, chat template,
config); resuming against anything else is refused, naming what differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from headstart.config import Recipe
from headstart.console import status
from headstart.errors import DataError
from headstart.fileio import exclusive_lock, read_json_object, remove_stale_temporaries
from headstart.nn.attention import AttentionBackend
from headstart.precompute.shards import ShardRecord, ShardWriter, read_record, shard_name, write_json_atomic

FORMAT = "headstart-precompute/1"
CONVENTION = {
    "last_hidden": "output of the last decoder layer before the final norm",
    "aux_layers": "hidden state entering decoder layer j (HF hidden_states[j]; j = 0 is the embedding output)",
}


def output_dir(recipe: Recipe) -> Path:
    return Path(recipe.precompute.output_dir or Path(recipe.output_dir) / "precompute")


def aux_layers_for(recipe: Recipe, num_layers: int) -> list[int]:
    """What the recipe's head consumes beyond the last hidden state (eagle3, dflash: three target layers)."""
    from headstart.heads.config import AUX_FAMILIES, default_aux_layers

    if recipe.head.type not in AUX_FAMILIES:
        return []
    if recipe.head.aux_layer_ids is not None:
        return list(recipe.head.aux_layer_ids)
    return default_aux_layers(num_layers)


def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Sequence index ranges [a, b) per shard: a shard closes once it holds >= shard_tokens tokens."""
    out, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        total += n
        if total >= shard_tokens:
            out.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out


def plan_batches(lengths: list[int], batch_tokens: int) -> list[tuple[int, int]]:
    out, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if total and total + n > batch_tokens:
            out.append((start, i))
            start, total = i, 0
        total += n
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out


SHARD_LABEL = "headstart.precompute.shard"


class EngineForward:
    """The serving forward: our model, our attention backend (FlashInfer on CUDA), fresh-prefill
    metadata over a paged KV cache, exactly as the engine prefills a batch of prompts."""

    def __init__(self, model: Any, device: torch.device, max_tokens: int, backend: str = "auto") -> None:
        from headstart.inference.backends import make_backend
        from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator

        self.model, self.device = model, device
        page = 16
        pages = -(-max_tokens // page) + 64
        self.allocator = PageAllocator(pages, page)
        self.cache = KVCache(KVCacheSpec.of(model), pages, page, device)
        self.backend: AttentionBackend = make_backend(backend, device, model=model)

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]], aux_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sequences -> (h (N, d), aux (N, A, d)). Each sequence takes whole pages, so many short rows
        can need more pages than their tokens suggest: the batch is cut into groups that fit the pool
        (attention never crosses sequences, so the grouping does not change the numbers)."""
        page = self.allocator.page_size
        groups, cur, need = [], [], 0
        for s in seqs:
            pages = -(-len(s) // page)
            if cur and need + pages > self.allocator.num_pages:
                groups.append(cur)
                cur, need = [], 0
            cur.append(s)
            need += pages
        groups.append(cur)
        outs = [self._forward(g, aux_layers) for g in groups]
        if len(outs) == 1:  # no copy
            return outs[0]
        h = torch.cat([o[0] for o in outs])
        aux = torch.cat([o[1] for o in outs]) if aux_layers else None
        return h, aux

    def _forward(self, seqs: list[list[int]], aux_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        from headstart.inference.runner import build_metadata

        items = []
        try:
            for i, s in enumerate(seqs):
                self.allocator.reserve(f"p{i}", len(s))
                items.append((f"p{i}", 0, len(s)))
            meta = build_metadata(self.allocator, items, self.device)
            ids = torch.tensor([t for s in seqs for t in s], device=self.device)
            h, aux = self.model(ids, meta, self.cache.layers, self.backend, capture=tuple(aux_layers))
        finally:  # pages are returned even when a reservation fails half-way
            for name, _, _ in items:
                self.allocator.release(name)
        stacked = torch.stack([aux[j] for j in aux_layers], dim=1) if aux_layers else None
        return h, stacked


class HFForward:
    """transformers with device_map="auto": for targets that do not fit one device. The pre-norm
    last hidden state is taken by a hook on the last decoder layer (HF's hidden_states[-1] is
    post-norm); aux layer j is HF hidden_states[j]."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        kw: dict[str, Any] = {"dtype": dtype}
        if torch.cuda.is_available():
            kw["device_map"] = "auto"
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kw).eval()
        self._last: torch.Tensor | None = None
        layer = self.model.model.layers[-1]
        layer.register_forward_hook(
            lambda _m, _i, out: setattr(self, "_last", out[0] if isinstance(out, tuple) else out))

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]], aux_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        hs, auxs = [], []
        dev = self.model.get_input_embeddings().weight.device
        for s in seqs:  # one sequence per call: no padding, so nothing depends on the batch
            out = self.model.model(torch.tensor([s], device=dev), output_hidden_states=bool(aux_layers))
            hs.append(self._last[0].cpu())
            if aux_layers:
                # HF's hidden_states[L] is post-norm; the convention (and the engine) stores the state
                # entering "layer L" pre-norm: the last layer's output, as for the last hidden state.
                last = len(out.hidden_states) - 1
                auxs.append(torch.stack([(self._last[0] if j == last else out.hidden_states[j][0]).cpu()
                                         for j in aux_layers], dim=1))
        return torch.cat(hs), torch.cat(auxs) if aux_layers else None


def _fingerprints(recipe: Recipe, dtype: str, target_fp: str, data_fp: str, template: str,
                  aux: list[int]) -> dict[str, str]:
    cfg = {"max_length": recipe.data.max_length, "split": recipe.precompute.split,
           "heldout_fraction": recipe.data.heldout_fraction, "split_key": recipe.data.split_key,
           "storage": recipe.precompute.storage,
           "shard_tokens": recipe.precompute.shard_tokens, "batch_tokens": recipe.precompute.batch_tokens,
           "aux_layers": aux, "dtype": dtype, "backend": recipe.precompute.backend}
    return {
        "target": target_fp,
        "dataset": data_fp,
        "template": hashlib.sha256((template or "").encode()).hexdigest(),
        "config": hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest(),
    }


def _dist(recipe: Recipe) -> tuple[Any, int, int]:
    """(tensor-parallel place, data-parallel rank, data-parallel world): the launched ranks form groups
    of engine.tensor_parallel that each shard one copy of the target; the groups split the shards."""
    from headstart.nn.parallel import init_tensor_parallel

    try:
        return init_tensor_parallel(recipe.engine.tensor_parallel)
    except ValueError as e:
        raise DataError(f"engine.tensor_parallel: {e}") from None


def run_precompute(recipe: Recipe, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Compute and store hidden states for the recipe's split; returns the manifest."""
    from headstart.assets import resolve_model
    from headstart.data.dataset import build_dataset
    from headstart.models import load_target

    tp, rank, world = _dist(recipe)
    if tp.enabled and recipe.precompute.backend == "hf":
        raise DataError("precompute.backend hf places the target with transformers' device_map; it cannot be "
                        "combined with engine.tensor_parallel (use backend engine)")
    out = output_dir(recipe)
    model_dir = resolve_model(recipe.target.model)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # otherwise every rank's kernels may land on GPU 0
    from headstart.hardware import describe, resolve_dtype
    from headstart.plan import check_recipe_fits

    check_recipe_fits(recipe, ("precompute",), device)  # before the target loads: refuse what cannot fit
    check_foreign(out)
    dtype = resolve_dtype(recipe.target.dtype, device)
    progress = progress and tp.rank == 0  # one bar per model copy
    if progress and rank == 0:
        status(f"precompute: target dtype {dtype} ({recipe.target.dtype}; {describe(device)})")
    model = load_target(model_dir, dtype, device, tp=tp)
    if recipe.precompute.backend == "engine":
        from headstart.inference.backends import check_backend

        check_backend(recipe.engine.backend, device, model)
    built = build_dataset(recipe.data, str(model_dir), progress=progress and rank == 0)
    split = recipe.precompute.split
    ds = built.train if split == "train" else built.heldout if split == "heldout" else None
    if ds is None:
        from datasets import concatenate_datasets

        ds = concatenate_datasets([built.train, built.heldout])
    if len(ds) == 0:
        raise DataError(f"the {split} split is empty; nothing to precompute")
    aux = aux_layers_for(recipe, model.config.num_hidden_layers)
    fps = _fingerprints(recipe, dtype, model.fingerprint(), built.fingerprint, built.tokenizer.chat_template, aux)
    header = {
        "format": FORMAT,
        "fingerprints": fps,
        "target": {"model": recipe.target.model, "dtype": dtype,
                   "hidden_size": model.config.hidden_size, "num_hidden_layers": model.config.num_hidden_layers,
                   "vocab_size": model.config.vocab_size},
        "dataset": {"source": recipe.data.source, "split": split, "limit": recipe.data.limit,
                    "max_length": recipe.data.max_length, "truncated": built.stats.truncated},
        "captured": {"last_hidden": True, "aux_layers": aux},
        "hidden_state_convention": CONVENTION,
        "storage": recipe.precompute.storage,
        "backend": recipe.precompute.backend,
    }
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: the precompute output directory is a file; choose another precompute.output_dir")
    # One writer per output directory (per rank): a second run would compute every shard again.
    lock = f".lock-rank{rank}" + (f"-tp{tp.rank}" if tp.enabled else "")
    with exclusive_lock(out / lock, what=f"precompute into {out}"):
        return _run(recipe, out, header, resume, rank, world, ds, model, model_dir, device, aux, progress, tp)


def _run(recipe: Recipe, out: Path, header: dict[str, Any], resume: bool, rank: int, world: int, ds: Any,
         model: Any, model_dir: Path, device: torch.device, aux: list[int], progress: bool,
         tp: Any) -> dict[str, Any]:
    """rank / world: this process's data-parallel place; the ranks of one tensor-parallel group run the
    same shards together and the group's rank 0 writes them."""
    from tqdm import tqdm

    from headstart.models.llama import DTYPES

    dtype = header["target"]["dtype"]
    writer = tp.rank == 0
    _check_output_dir(out, header, resume, rank if writer else -1)
    if writer:
        remove_stale_temporaries(out)  # shards of a killed process; live ranks' are kept
    if torch.distributed.is_initialized():  # a shard's temporary lives while it is computed: no rank opens one
        torch.distributed.barrier()         # before every rank (on any node: PIDs are per host) has cleaned up
    lengths = list(ds["num_tokens"])
    shards = plan_shards(lengths, recipe.precompute.shard_tokens)
    mine = [i for i in range(len(shards)) if i % world == rank]
    todo = [i for i in mine if not (out / shard_name(i)).exists()]
    if tp.enabled:  # every rank of the group must run the same forwards: the writer's list is the list
        box = [todo]
        torch.distributed.broadcast_object_list(box, src=torch.distributed.get_global_rank(tp.group, 0),
                                                group=tp.group)
        todo = box[0]
    forward = (HFForward(model_dir, DTYPES[dtype]) if recipe.precompute.backend == "hf" else
               EngineForward(model, device, max(recipe.precompute.batch_tokens, max(lengths)), recipe.engine.backend))
    tokens_todo = sum(sum(lengths[a:b]) for a, b in (shards[i] for i in todo))
    bar = tqdm(total=tokens_todo, unit="tok", unit_scale=True, disable=not progress,
               desc=f"precompute{f' rank {rank}' if world > 1 else ''}", position=rank)
    written_bytes, start = 0, time.perf_counter()
    for i in todo:
        a, b = shards[i]
        rows = ds.select(range(a, b))
        seqs = [list(r) for r in rows["input_ids"]]
        # each batch goes to its place in the file as it comes (quantised on the device): a rank holds one
        # batch of states on the host, not the shard's
        shard = contextlib.nullcontext() if not writer else ShardWriter(
            out / shard_name(i), i, torch.tensor([t for s in seqs for t in s]),
            torch.tensor([m for r in rows["loss_mask"] for m in r], dtype=torch.uint8), [len(s) for s in seqs],
            model.config.hidden_size, len(aux), recipe.precompute.storage)
        # the label marks the shard's forwards and writes in a profiler's trace (tests/test_precompute_memory.py)
        with shard as w, torch.profiler.record_function(SHARD_LABEL):
            for ba, bb in plan_batches([len(s) for s in seqs], recipe.precompute.batch_tokens):
                h, x = forward(seqs[ba:bb], aux)
                if w is not None:
                    w.add(h, x)
                del h, x
                bar.update(sum(len(s) for s in seqs[ba:bb]))
            if w is None:
                continue
            rec = w.close()
        written_bytes += rec.bytes
        bar.set_postfix(shard=i, written=f"{written_bytes / 1e6:.1f}MB")
    bar.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    manifest = None
    if rank == 0 and writer:
        manifest = _write_manifest(out, header, len(shards))
        if progress:
            secs = time.perf_counter() - start
            status(f"precompute: {manifest['sequences']:,} sequences, {manifest['tokens']:,} tokens in "
                  f"{len(shards)} shards -> {out} ({secs:.1f}s this run, "
                  f"{manifest['bytes_per_token']:.1f} bytes/token, {manifest['storage']})")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return manifest or json.loads((out / "manifest.json").read_text())


def check_foreign(out: Path) -> None:
    """A precompute directory without run.json holds nothing but our locks and temporaries: a
    manifest.json, shards or anything else there are someone else's, and are never written over."""
    if (out / "run.json").exists() or not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if not (p.name.startswith(".lock-rank") or ".tmp-" in p.name))
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else "")
        what = "shards of another run" if any(n.startswith("shard-") for n in foreign) else "files of someone else's"
        raise DataError(f"{out} holds {what} ({listed}) and no run.json: it is not a precompute run of headstart, "
                        "and precompute would write over them; choose another precompute.output_dir, or move them out")


def _check_output_dir(out: Path, header: dict[str, Any], resume: bool, rank: int) -> None:
    run_file = out / "run.json"
    check_foreign(out)
    has_data = out.exists() and any(out.glob("shard-*.safetensors"))
    if run_file.exists():
        prev = read_json_object(run_file, "run record")
        diff = [k for k, v in header["fingerprints"].items() if prev.get("fingerprints", {}).get(k) != v]
        if diff:
            raise DataError(
                f"{out} holds a run with a different {', '.join(diff)} fingerprint; refusing to "
                f"{'resume' if resume else 'overwrite'} (choose another precompute.output_dir)"
            )
        if not resume and has_data:
            raise DataError(f"{out} already holds shards of this run; pass --resume to continue it")
    elif has_data:
        raise DataError(f"{out} holds shards of another run (no run.json); choose another precompute.output_dir")
    if rank == 0:  # (-1: a tensor-parallel rank that writes nothing)
        write_json_atomic(run_file, header)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _write_manifest(out: Path, header: dict[str, Any], num_shards: int) -> dict[str, Any]:
    records: list[ShardRecord] = []
    for i in range(num_shards):
        path = out / shard_name(i)
        if not path.exists():
            raise DataError(f"{path}: shard {i} was not written; rerun with --resume")
        rec = read_record(path)
        if rec.index != i:
            raise DataError(f"{path}: holds shard {rec.index}, expected {i}")
        records.append(rec)
    tokens = sum(r.tokens for r in records)
    errors = [r.fp8_rel_error for r in records if r.fp8_rel_error is not None]
    manifest = {
        **header,
        "sequences": sum(r.sequences for r in records),
        "tokens": tokens,
        "bytes": sum(r.bytes for r in records),
        "bytes_per_token": sum(r.bytes for r in records) / max(tokens, 1),
        "fp8_rel_error": max(errors) if errors else None,
        "shards": [dataclasses.asdict(r) for r in records],
    }
    write_json_atomic(out / "manifest.json", manifest)
    return manifest
