"""Training-time test (TTT): unroll the head over its own outputs, as it runs when it drafts.

In the engine, after the target's states for positions 0..m are absorbed, draft step j (1..k) runs
one row at position m + j whose feature is the head's own output at m + j - 1, attending to the
absorbed rows 0..m and to the draft rows m+1..m+j-1. Unrolled over a packed sequence, step j runs
every row p at once with feature o^{j-1}_{p-1} (step j-1's output one row back) and attends to

    step-0 keys at positions 0..p-j   and   step-j' keys at position p-j+j' for j' = 1..j

Worked example, p = 5, j = 2: step-0 keys 0..3, the step-1 key at 4, its own step-2 key at 5 —
exactly the cache the engine holds when it drafts the 2nd token after absorbing positions 0..3.
Rows p < j have no such history; they are computed (harmlessly) and excluded from the loss.
Tokens are the ground truth (t_{p+1}) at every step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headstart.heads.base import DraftHead, PackedBatch, Shifted, shift_for_head
from headstart.nn.attention import AttentionMetadata, packed_metadata


class UnrolledAttention:
    """Attention backend for the unroll: each layer's `cache` is a list collecting its K/V per step."""

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
            qs = q[row:row + n].float()  # (n, H, D)
            k0, v0 = (_expand(t[row:row + n], rep).float() for t in cache[0])  # (n, H, D)
            r = torch.arange(n, device=q.device)
            s0 = torch.einsum("rhd,chd->hrc", qs, k0) * scale  # (H, n, n)
            allowed = torch.arange(n, device=q.device)[None, :] <= (r - j).clamp(min=0)[:, None]  # (n, n)
            s0 = s0.masked_fill(~allowed, float("-inf"))
            diag_s, diag_v = [], []
            for jp in range(1, j + 1):
                src = r - j + jp  # (n,) the row of step jp this query sees
                kj, vj = (_expand(t[row:row + n], rep).float()[src.clamp(min=0)] for t in cache[jp])  # (n, H, D)
                sj = (qs * kj).sum(-1).transpose(0, 1) * scale  # (H, n)
                diag_s.append(sj.masked_fill((src < 0)[None, :], float("-inf")))
                diag_v.append(vj)
            scores = torch.cat([s0, torch.stack(diag_s, dim=-1)], dim=-1)  # (H, n, n + j)
            p = torch.softmax(scores, dim=-1)
            o = torch.einsum("hrc,chd->rhd", p[..., :n], v0)  # (n, H, D)
            for i, vj in enumerate(diag_v):
                o = o + p[..., n + i].transpose(0, 1).unsqueeze(-1) * vj
            outs.append(o.to(q.dtype))
            row += n
        return torch.cat(outs)


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


def unroll(head: DraftHead, batch: PackedBatch, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor], Shifted]:
    """-> (outputs per step [(M, d)], valid rows per step [(M,) bool], the shifted rows)."""
    shifted = shift_for_head(batch.input_ids, batch.seq_lens, batch.loss_mask)
    hid = batch.hidden[shifted.src_rows] if batch.hidden is not None else None
    aux = batch.aux_hidden[shifted.src_rows] if batch.aux_hidden is not None else None
    features = head.target_features(hid, aux)
    device = features.device
    meta = packed_metadata(shifted.seq_lens, device=device)
    tokens = shifted.tokens.to(device)
    caches: list[list] = [[] for _ in range(head.kv_layers())]
    backend = UnrolledAttention()
    first = torch.zeros(tokens.numel(), dtype=torch.bool, device=device)
    first[meta.qo_indptr[:-1].long()] = True  # each sequence's row 0 has no predecessor
    outs, valid = [], []
    for j in range(steps):
        if j > 0:
            prev = outs[-1]
            features = torch.where(first[:, None], prev, torch.roll(prev, 1, dims=0))  # o^{j-1}_{p-1}
        outs.append(head.forward_hidden(tokens, features, meta, caches, backend))
        valid.append(meta.positions >= j)
    return outs, valid, shifted
