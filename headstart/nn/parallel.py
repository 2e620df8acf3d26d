"""Tensor parallelism (Megatron-style) for the target: which slice of each weight a rank holds, and the
two collectives a sharded forward needs.

A tensor-parallel group of `size` ranks splits every decoder layer in two places, one all-reduce each:
- attention: q heads split evenly; the qkv projection is column-parallel (each rank computes its own
  heads' q, k, v); o_proj is row-parallel (each rank multiplies its heads' slice of the input
  columns) and the partial outputs are summed over the group;
- MLP: the fused gate/up projection is column-parallel over the intermediate dimension, down_proj is
  row-parallel, then one all-reduce.
KV heads split like q heads where there are at least as many as ranks; with fewer (a 70B target has 8
KV heads: tp 16 or a GQA-1 model), each KV head is replicated on the ranks whose q heads read it, as
vLLM does. The embedding and the lm_head are vocab-parallel: rank r holds rows [r·Vr, (r+1)·Vr) of
the vocabulary (the last rank zero-padded when V is not a multiple of the size); a token's embedding
comes from the one rank that holds it (an all-reduce of one non-zero term: exact); logits are
all-gathered along the vocabulary. Norms, RoPE tables and every residual state are replicated, so the
hidden states a head reads, precompute stores and the sampler's logits are whole on every rank.

Every rank runs the same engine (scheduler, sampler, proposer) over the same inputs, so the ranks
call the collectives in the same order; a head is replicated (it is small and reads whole states).
On CPU the sums run in fp32 whatever the activation dtype: a row-parallel output is rounded twice (each
rank's partial product, then the sum) where one rank rounds once, so sharded logits agree with one
rank's within a tolerance (tests/test_tensor_parallel.py states it), not bit for bit. On CUDA they run
in the activation dtype, as vLLM's and Megatron's do: half the bytes of an fp32 sum over NVLink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from headstart.nn.linear import Linear


@dataclass(frozen=True)
class TensorParallel:
    """A rank's place in its tensor-parallel group; size 1 (the default) is no parallelism at all."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is not a valid place")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of n items; n must divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        part = n // self.size
        return self.rank * part, part

    def vocab_range(self, vocab: int) -> tuple[int, int, int]:
        """(start, end, rows per rank) of this rank's vocabulary rows; the rows are ceil(V / size), so
        the last rank may hold fewer real rows than `rows` (its tail is zero padding)."""
        rows = -(-vocab // self.size)
        start = min(vocab, self.rank * rows)
        return start, min(vocab, start + rows), rows

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds for its q heads."""
        q_start, q_local = self.split(num_heads, "num_attention_heads")
        group = num_heads // num_kv_heads  # q heads per KV head
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if group % q_local:
            raise ValueError(f"num_key_value_heads {num_kv_heads} cannot be replicated over tensor-parallel size "
                             f"{self.size}: a rank's {q_local} q heads would read two KV heads")
        return q_start // group, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group (on CPU an fp32 sum cast back to x's dtype; on CUDA in x's dtype)."""
        if not self.enabled:
            return x
        import torch.distributed as dist

        acc = x.float().contiguous() if x.dtype != torch.float32 and not x.is_cuda else x.contiguous().clone()
        dist.all_reduce(acc, group=self.group)
        return acc.to(x.dtype)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (rank order)."""
        if not self.enabled:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


def vocab_rows(weight: torch.Tensor, ids: torch.Tensor, start: int, end: int, tp: TensorParallel) -> torch.Tensor:
    """Whole rows (ids.shape + (D,)) of a vocab-parallel weight that holds vocabulary rows [start, end):
    each rank contributes the rows it holds and zeros elsewhere, and the sum has one non-zero term (exact)."""
    mine = (ids >= start) & (ids < end)
    local = torch.nn.functional.embedding(torch.where(mine, ids - start, torch.zeros_like(ids)), weight)
    return tp.all_reduce(local * mine.unsqueeze(-1).to(weight.dtype))


class VocabParallelEmbedding(torch.nn.Embedding):
    """An embedding whose rows are this rank's vocabulary range; forward returns whole embeddings on
    every rank. With size 1 it is a plain nn.Embedding (same parameter name, same numerics)."""

    def __init__(self, vocab: int, dim: int, tp: TensorParallel = SINGLE) -> None:
        self.tp, self.vocab = tp, vocab
        self.start, self.end, rows = tp.vocab_range(vocab)
        super().__init__(rows if tp.enabled else vocab, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().forward(ids)
        return vocab_rows(self.weight, ids, self.start, self.end, self.tp)


class VocabParallelLinear(Linear):
    """The lm_head over this rank's vocabulary rows; forward returns whole (N, V) logits on every rank
    (the local logits all-gathered, the padding cut). With size 1 it is a plain Linear."""

    def __init__(self, dim: int, vocab: int, tp: TensorParallel = SINGLE) -> None:
        self.tp, self.vocab = tp, vocab
        self.start, self.end, rows = tp.vocab_range(vocab)
        super().__init__(dim, rows if tp.enabled else vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.tp.enabled:
            return out
        return self.tp.all_gather_last(out)[..., : self.vocab]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole weight rows for vocabulary ids (len(ids), D) on every rank: each row comes from the
        rank that holds it (a draft vocabulary's restricted lm_head is built from them once)."""
        w = self.weight.detach()
        return vocab_rows(w, ids, self.start, self.end, self.tp) if self.tp.enabled else w[ids]


def init_tensor_parallel(size: int, timeout_s: float = 1800.0,
                         backend: str | None = None) -> tuple[TensorParallel, int, int]:
    """Join the process group a launcher (torchrun, SLURM via torchrun) describes in the environment
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and split it into tensor-parallel groups of `size`
    consecutive ranks (ranks of one node first: the all-reduces stay on NVLink). Returns this rank's
    TensorParallel and its data-parallel place (rank, world) among the groups. `backend`: default
    NCCL where CUDA is available, else gloo (a CPU run on a GPU machine passes gloo); `timeout_s`
    bounds every collective wait (a lost rank fails the others instead of hanging)."""
    import datetime

    import torch.distributed as dist

    from headstart.launch import launch_env

    world, rank = launch_env()
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    if world % size:
        raise ValueError(f"tensor-parallel size {size} does not divide the {world} launched ranks "
                         f"(launch a multiple of {size} processes, e.g. torchrun --nproc-per-node {size})")
    if size == 1 and world == 1:
        return SINGLE, 0, 1
    if not dist.is_initialized():
        from headstart.launch import rendezvous

        rendezvous()  # bounded, naming the ranks that never came (the group's own wait is timeout_s)
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    groups = [dist.new_group(ranks) for ranks in tp_groups(world, size)]
    tp_rank, group, dp_rank, dp_world = tp_layout(rank, world, size)
    return TensorParallel(tp_rank, size, groups[group]), dp_rank, dp_world


def tp_groups(world: int, size: int) -> list[list[int]]:
    """The tensor-parallel groups of `world` ranks: consecutive ranks, `size` each."""
    return [list(range(g * size, (g + 1) * size)) for g in range(world // size)]


def tp_layout(rank: int, world: int, size: int) -> tuple[int, int, int, int]:
    """(rank in its tensor-parallel group, the group's index, data-parallel rank, data-parallel world)."""
    if world % size or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world} has no place in tensor-parallel groups of {size}")
    return rank % size, rank // size, rank // size, world // size
