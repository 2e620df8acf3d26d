"""Training data: sequences from precompute shards (read lazily) or token-only sequences for the
online source, packed into token-budget micro-batches, shuffled per epoch, split across ranks, and
resumable mid-epoch.

The order is a pure function of (seed, epoch, rank, world): epoch e shuffles the sequence indices
with a generator seeded by (seed, e), packs them greedily into micro-batches of at most
`batch_tokens` tokens (a sequence is never split), and rank r takes micro-batches r, r + W, ...
(the tail that does not fill every rank is dropped, so ranks stay in step). Resuming after n
consumed micro-batches replays that arithmetic and skips them without loading a shard.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from safetensors import safe_open

from headstart.console import status
from headstart.errors import DataError
from headstart.heads.base import PackedBatch
from headstart.precompute.manifest import read_manifest
from headstart.precompute.shards import from_fp8


@dataclass
class SeqRef:
    shard: int  # index into the source's shard list
    start: int  # first token row in the shard
    length: int


class ShardSequences:
    """Sequences of a precompute directory, read lazily (memory-mapped) one micro-batch at a time."""

    def __init__(self, directory: str | Path, expect_target: str | None = None,
                 expect_aux: list[int] | None = None, keep_fp8: bool = False) -> None:
        """keep_fp8: fp8 shards' states are returned as stored, with their scales (PackedBatch.hidden_scale),
        for the step to dequantise on its device: half the bytes through pinned memory and the copy."""
        self.dir = Path(directory)
        self.keep_fp8 = keep_fp8
        manifest = read_manifest(self.dir)
        if expect_target is not None and manifest["fingerprints"]["target"] != expect_target:
            raise DataError(
                f"{self.dir}: shards were computed with target {manifest['fingerprints']['target'][:16]}…, the "
                f"recipe's target is {expect_target[:16]}… ({manifest['target']['model']} vs this recipe's); "
                "rerun precompute for this target or point train.shards_dir at matching shards")
        have_aux = list(manifest["captured"]["aux_layers"])
        if expect_aux and have_aux != list(expect_aux):
            raise DataError(f"{self.dir}: shards hold aux layers {have_aux}, the head needs {list(expect_aux)}; "
                            "rerun precompute with this recipe's head section")
        self.manifest = manifest
        self.records = manifest["shards"]
        self.refs: list[SeqRef] = []
        for si, rec in enumerate(self.records):
            path = self.dir / rec["name"]
            if not path.is_file() or path.stat().st_size != rec["bytes"]:
                raise DataError(f"{path}: missing or a different size than the manifest says; run "
                                f"`headstart precompute verify {self.dir}`")
            with safe_open(str(path), framework="pt") as f:
                offsets = f.get_tensor("seq_offsets").tolist()
            self.refs += [SeqRef(si, a, b - a) for a, b in zip(offsets[:-1], offsets[1:])]
        self.lengths = [r.length for r in self.refs]
        self._handles: dict[int, Any] = {}

    def _handle(self, shard: int) -> Any:
        """The shard's open file, after checking its size: the file is memory-mapped, and reading a
        mapping past the end of a file truncated since (a full disk, a user) kills the process with
        a bus error instead of raising."""
        rec = self.records[shard]
        path = self.dir / rec["name"]
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise DataError(f"{path}: shard {shard} cannot be read ({e.strerror or e}); run "
                            f"`headstart precompute verify {self.dir}`") from None
        if size != rec["bytes"]:
            raise DataError(f"{path}: shard {shard} has {size:,} bytes, the manifest says {rec['bytes']:,} (truncated "
                            f"or replaced during training); run `headstart precompute verify {self.dir}`")
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(path), framework="pt")
        return self._handles[shard]

    def load(self, indices: list[int]) -> PackedBatch:
        ids, masks, hs, auxs, lens, h_scales, a_scales = [], [], [], [], [], [], []
        for i in indices:
            ref = self.refs[i]
            f = self._handle(ref.shard)
            a, b = ref.start, ref.start + ref.length

            def rows(name: str, f: Any = f, a: int = a, b: int = b) -> torch.Tensor:
                return f.get_slice(name)[a:b]

            keys = set(f.keys())
            raw = self.keep_fp8 and "hidden_scale" in keys
            ids.append(rows("input_ids").long())
            masks.append(rows("loss_mask"))
            if raw:
                hs.append(rows("hidden"))
                h_scales.append(rows("hidden_scale"))
            else:
                hs.append(from_fp8(rows("hidden"), rows("hidden_scale")) if "hidden_scale" in keys else rows("hidden"))
            if "aux_hidden" in keys:
                x = rows("aux_hidden")
                if raw and "aux_scale" in keys:
                    auxs.append(x)
                    a_scales.append(rows("aux_scale"))
                else:
                    auxs.append(from_fp8(x, rows("aux_scale")) if "aux_scale" in keys else x)
            lens.append(ref.length)
        return PackedBatch(torch.cat(ids), lens, torch.cat(hs), torch.cat(auxs) if auxs else None, torch.cat(masks),
                           torch.cat(h_scales) if h_scales else None, torch.cat(a_scales) if a_scales else None)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen their own handles
        return {**self.__dict__, "_handles": {}}


class ArrowSequences:
    """Token ids + loss masks of the online source, read one micro-batch at a time from the tokenised
    dataset's Arrow table (memory-mapped from the dataset cache): nothing per token lives in Python
    objects, and the ranks and loader workers of a node share the file's pages. As Python lists the
    same data cost ~36 bytes a token in every process (~27 GB each at 600M tokens)."""

    def __init__(self, ds: Any) -> None:
        import pyarrow.compute as pc

        self.ds = ds.with_format("arrow")
        self.lengths = pc.list_value_length(self.ds["input_ids"]).to_pylist()  # one int per sequence

    def load(self, indices: list[int]) -> PackedBatch:
        import numpy as np

        rows = self.ds[list(indices)]  # a pyarrow Table, in `indices` order

        def flat(name: str) -> np.ndarray:
            col = rows.column(name).combine_chunks()
            return np.asarray(col.flatten())

        ids = torch.from_numpy(flat("input_ids").astype(np.int64))
        mask = torch.from_numpy(flat("loss_mask").astype(np.uint8))
        return PackedBatch(ids, [self.lengths[i] for i in indices], None, None, mask)


def supervised_token_counts(source: ArrowSequences, vocab: int, sequences: int | None = None) -> torch.Tensor:
    """How often each token id is supervised (loss mask 1) in the first `sequences` sequences (None: all), float64.
    Read in blocks of sequences from the Arrow table: the whole column as Python lists would cost ~36 bytes a token
    in every rank."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    n = len(source.lengths) if sequences is None else min(len(source.lengths), sequences)
    for a in range(0, n, 4096):
        b = source.load(list(range(a, min(a + 4096, n))))
        counts += torch.bincount(b.input_ids[b.loss_mask.bool()], minlength=vocab).double()
    return counts


class TokenSequences:
    """Token ids + loss masks only (online source, held-out data): hidden states come from the target."""

    def __init__(self, input_ids: list[list[int]], loss_mask: list[list[int]]) -> None:
        self.ids, self.masks = input_ids, loss_mask
        self.lengths = [len(x) for x in input_ids]

    @classmethod
    def from_dataset(cls, ds: Any) -> TokenSequences:
        return cls([list(x) for x in ds["input_ids"]], [list(x) for x in ds["loss_mask"]])

    def load(self, indices: list[int]) -> PackedBatch:
        ids = torch.tensor([t for i in indices for t in self.ids[i]], dtype=torch.long)
        mask = torch.tensor([m for i in indices for m in self.masks[i]], dtype=torch.uint8)
        return PackedBatch(ids, [len(self.ids[i]) for i in indices], None, None, mask)


def pack(order: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Greedy packing in the given order: a micro-batch closes before the sequence that would overflow it."""
    batches, cur, total = [], [], 0
    for i in order:
        n = lengths[i]
        if cur and total + n > batch_tokens:
            batches.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        batches.append(cur)
    return batches


class PackedStream(torch.utils.data.IterableDataset):
    """Micro-batches for one rank, epoch after epoch, starting after `skip` consumed ones. `sequences`: only
    the source's first N sequences are trained on (train.max_sequences; None: all)."""

    def __init__(self, source: ShardSequences | TokenSequences, batch_tokens: int, seed: int,
                 rank: int = 0, world: int = 1, epochs: int | None = None, sequences: int | None = None) -> None:
        super().__init__()
        if sequences is not None and sequences > len(source.lengths):
            raise DataError(f"train.max_sequences={sequences} but the training split holds {len(source.lengths)} "
                            "sequences; lower it or set it to null (all)")
        lengths = source.lengths[:sequences]
        cut = f" (train.max_sequences={sequences})" if sequences is not None else ""
        usable = [n for n in lengths if n >= 3]  # fewer than 3 tokens: no supervised shifted row
        if not usable:
            raise DataError(f"the training split{cut} holds no sequence of 3 or more tokens; nothing to train on")
        longest = max(lengths)
        if longest > batch_tokens:
            raise DataError(f"train.batch_tokens={batch_tokens} is smaller than the longest training sequence "
                            f"({longest} tokens); set train.batch_tokens >= data.max_length")
        self.source, self.batch_tokens, self.seed = source, batch_tokens, seed
        self.rank, self.world, self.epochs = rank, world, epochs
        self.indices = [i for i, n in enumerate(lengths) if n >= 3]  # never past `sequences`
        self.skip = 0
        if not self.epoch_batches(0):
            raise DataError(f"the training split{cut} packs into fewer micro-batches than ranks ({self.world}); "
                            "add data or lower train.batch_tokens")

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.indices), generator=g).tolist()
        batches = pack([self.indices[p] for p in perm], self.source.lengths, self.batch_tokens)
        usable = len(batches) // self.world * self.world
        return batches[self.rank:usable:self.world]

    def position(self, consumed: int) -> tuple[int, int]:
        """(epoch, micro-batch within the epoch) after `consumed` micro-batches of this rank."""
        epoch = 0
        while True:
            n = len(self.epoch_batches(epoch))
            if consumed < n:
                return epoch, consumed
            consumed -= n
            epoch += 1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # DataLoader workers take turns (worker w loads micro-batches w, w + W, ...); the loader
        # yields them round-robin, so the order is the same with any number of workers.
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, offset = self.position(self.skip)
        n = 0
        while self.epochs is None or epoch < self.epochs:
            for i, seqs in enumerate(self.epoch_batches(epoch)):
                if i < offset:
                    continue
                if n % workers == worker:
                    yield {"batch": self.source.load(seqs), "epoch": epoch}
                n += 1
            epoch, offset = epoch + 1, 0


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    (item,) = items  # micro-batches are packed already
    return item


class TrainData(L.LightningDataModule):
    """The training stream as a LightningDataModule whose checkpointed state is the data position:
    the micro-batches this rank consumed (counted by the module), restored before iteration starts."""

    def __init__(self, stream: PackedStream, num_workers: int = 0) -> None:
        super().__init__()
        self.stream, self.num_workers = stream, num_workers

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # Pinned host memory: the copy to a GPU runs asynchronously (fp8 shards stay fp8 until then).
        return torch.utils.data.DataLoader(self.stream, batch_size=1, collate_fn=collate, num_workers=self.num_workers,
                                           pin_memory=torch.cuda.is_available())

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": int(getattr(self.trainer.lightning_module, "consumed", 0))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.skip = int(state.get("consumed", 0))


def check_training_split(shards: Path, source: ShardSequences, built: Any, data: Any) -> None:
    """Shards are the recipe's own training split, or a DataError names how they differ: other data (the
    dataset fingerprint: source content, limit, max_length, max_turns, tokenizer, template), another split
    (precompute.split heldout or all: rows the run validates on) or another split of the same data (held-out
    fraction, split key: the sequences differ from the training split's)."""
    made = source.manifest["dataset"]
    made_fp = source.manifest["fingerprints"].get("dataset")
    if made_fp != built.fingerprint:
        have = f"dataset fingerprint {made_fp[:12]}…" if made_fp else "no dataset fingerprint in its manifest"
        raise DataError(f"{shards}: precomputed from other data than this recipe's data section gives (the shards: "
                        f"source {made.get('source')}, limit {made.get('limit')}, max_length {made.get('max_length')}; "
                        f"{have} against {built.fingerprint[:12]}…): precompute this recipe, or give it the data "
                        "section the shards were made with (data.source, limit, max_length, max_turns)")
    if made.get("split") != "train":
        raise DataError(f"{shards}: these shards hold split {made.get('split')}, which holds rows the run validates "
                        "on; training reads the training split: precompute with precompute.split: train")
    if list(source.lengths) != list(built.train["num_tokens"]):
        raise DataError(f"{shards}: these shards hold {len(source.lengths)} sequences that are not this recipe's "
                        f"training split ({len(built.train)} sequences at data.heldout_fraction {data.heldout_fraction}"
                        f", split_key {data.split_key}): they were made with another split; precompute this recipe")


def install_draft_vocab(head: Any, vocab: int, train_ds: Any, sequences: int | None, *, keep: bool,
                        announce: bool) -> None:
    """The head's draft vocabulary: the most frequent supervised target tokens of the training split
    (deterministic: a resumed run rebuilds the maps its checkpoint holds), among the target's `vocab` ids; with
    `keep`, the head's own (head.init_from: its lm_head rows are those tokens'). With `announce`,
    prints its coverage of the supervised training tokens."""
    from headstart.heads import build_vocab_maps
    from headstart.heads.vocab import target_ids

    if keep and not announce:
        return  # the head's own maps, and nothing to print: no pass over the data
    counts = supervised_token_counts(ArrowSequences(train_ds), vocab, sequences)
    vd = head.config.draft_vocab_size
    if keep:  # Medusa keeps d2t only: the mask from it (once, at start-up)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids(head.d2t).cpu()] = True
    else:
        d2t, t2d = build_vocab_maps(counts, vd)
        head.set_vocab_maps(d2t, t2d)
    coverage = float(counts[t2d].sum() / counts.sum().clamp(min=1))
    if announce:
        whose = "the initial head's " if keep else ""
        status(f"train: {whose}draft vocabulary {vd:,} of {vocab:,} tokens covers {100 * coverage:.1f}% of the "
               "supervised training tokens (the target's probability mass inside it is reported as "
               "draft_vocab_mass at each validation)")
