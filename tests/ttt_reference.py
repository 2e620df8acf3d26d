"""The TTT attention of headstart before issue 32 (a loop over sequences x query blocks x steps), kept as
the reference that tests/test_train_parts.py compares the batched one with (outputs and gradients) and
that benchmarks/train_ops.py counts ops against. Install it with `use_looped(monkeypatch)`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from headstart.nn.attention import AttentionMetadata


class LoopedUnrolledAttention:
    """The unrolled attention as it was before it became one call per step: a Python loop over packed
    sequences and 256-query blocks, fp32 scores, K/V repeated per cached step."""

    name = "unrolled"

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> None:
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: list,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        cache.append((k, v))
        j = len(cache) - 1
        if j == 0:  # plain causal attention within each packed sequence
            return _causal(q, k, v, meta, scale)
        outs, row = [], 0
        rep = q.shape[1] // k.shape[1]
        for n in meta.q_lens_cpu:
            sl = slice(row, row + n)
            qs = q[sl]
            keys = [(_expand(kc[sl], rep), _expand(vc[sl], rep)) for kc, vc in cache]
            # Query blocks, each recomputed in the backward pass: no (H, n, n) score tensor is kept, and
            # the live scores are (H, QUERY_BLOCK, <= n) whatever the sequence length.
            blocks = []
            for a in range(0, n, QUERY_BLOCK):
                b = min(n, a + QUERY_BLOCK)
                args = (qs[a:b], keys[0][0][:b], keys[0][1][:b], *(t[max(0, a - j):b] for kv in keys[1:] for t in kv))
                if torch.is_grad_enabled() and any(t.requires_grad for t in args):
                    blocks.append(checkpoint(_unrolled_block, a, j, scale, *args, use_reentrant=False))
                else:
                    blocks.append(_unrolled_block(a, j, scale, *args))
            outs.append(torch.cat(blocks) if len(blocks) > 1 else blocks[0])
            row += n
        return torch.cat(outs)


# Queries per block of the unrolled attention (steps j >= 1).
QUERY_BLOCK = 256


def _unrolled_block(a: int, j: int, scale: float, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                    *diag: torch.Tensor) -> torch.Tensor:
    """Unrolled step j for the queries at rows a..a+m-1 of one sequence: step-0 keys 0..p-j (k0, v0
    hold rows 0..a+m-1) and, for each step j' = 1..j, the one key at row p-j+j' (`diag`: that step's
    K and V at rows max(0, a-j)..a+m-1). Softmax over all of them in fp32; returns (m, H, D)."""
    m = q.shape[0]
    qs = q.float()
    r = torch.arange(a, a + m, device=q.device)  # the queries' rows in the sequence
    s0 = torch.einsum("rhd,chd->hrc", qs, k0.float()) * scale  # (H, m, a + m)
    allowed = torch.arange(k0.shape[0], device=q.device)[None, :] <= (r - j).clamp(min=0)[:, None]
    s0 = s0.masked_fill(~allowed, float("-inf"))
    base = max(0, a - j)  # row of diag[...][0]
    diag_s, diag_v = [], []
    for jp in range(1, j + 1):
        kj, vj = diag[2 * (jp - 1)], diag[2 * (jp - 1) + 1]
        src = r - j + jp  # the row of step jp this query sees
        idx = (src.clamp(min=0) - base)
        kj, vj = kj.float()[idx], vj.float()[idx]  # (m, H, D)
        sj = (qs * kj).sum(-1).transpose(0, 1) * scale  # (H, m)
        diag_s.append(sj.masked_fill((src < 0)[None, :], float("-inf")))
        diag_v.append(vj)
    p = torch.softmax(torch.cat([s0, torch.stack(diag_s, dim=-1)], dim=-1), dim=-1)  # (H, m, a + m + j)
    o = torch.einsum("hrc,chd->rhd", p[..., : k0.shape[0]], v0.float())  # (m, H, D)
    for i, vj in enumerate(diag_v):
        o = o + p[..., k0.shape[0] + i].transpose(0, 1).unsqueeze(-1) * vj
    return o.to(q.dtype)


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    outs, row = [], 0
    gqa = q.shape[1] != k.shape[1]
    for n in meta.q_lens_cpu:
        qs, ks, vs = (t[row:row + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, n, D)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=n > 1, scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(outs)


def use_looped(patch) -> None:
    """Make headstart.train.ttt.unroll run the looped attention (`patch`: a pytest monkeypatch)."""
    import headstart.train.ttt as ttt

    patch.setattr(ttt, "UnrolledAttention", LoopedUnrolledAttention)
