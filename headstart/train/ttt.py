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

from typing import Any

import torch
import torch.nn.functional as F

from headstart.heads.base import DraftHead, PackedBatch, Shifted, shift_for_head
from headstart.nn.attention import AttentionMetadata, additive_mask, fused_kv, packed_metadata, padded_layout
from headstart.train.ttt_cpu import MergedStep


def _step_attention(q: torch.Tensor, kvs: tuple[torch.Tensor, ...], mask: torch.Tensor | None, j: int,
                    scale: float) -> torch.Tensor:
    """Step j's attention over one bucket: q (B, L, Hq, D); kvs = (K_0, V_0, ..., K_j, V_j), each step's own
    (B, L, Hkv, D) -> (B, L, Hq, D). Position p of step j''s copy holds that step's key at p - (j - j');
    positions rolled in are masked (UnrolledAttention)."""
    keys = torch.cat([kvs[0]] + [torch.roll(kvs[2 * jp], j - jp, dims=1) for jp in range(1, j + 1)], dim=1)
    values = torch.cat([kvs[1]] + [torch.roll(kvs[2 * jp + 1], j - jp, dims=1) for jp in range(1, j + 1)], dim=1)
    keys, values, gqa = fused_kv(q, keys, values)  # (B, L (j + 1), Hkv or Hq, D)
    return F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                          attn_mask=mask, is_causal=mask is None and q.shape[1] > 1, scale=scale,
                                          enable_gqa=gqa).transpose(1, 2)


class _RecomputedStep(torch.autograd.Function):
    """`_step_attention` keeping only its inputs for backward: the queries and every step's own K/V, which
    later steps share (T copies over T steps), not the (j + 1) concatenated copies of each step (T (T + 1)
    / 2, expanded to the query heads on CUDA): the backward pass rebuilds them and reruns the step's
    forward (one more fused attention call per step), under the autocast state of the forward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, mask: torch.Tensor | None, j: int, scale: float,  # noqa: ANN001
                *kvs: torch.Tensor) -> torch.Tensor:
        kind = q.device.type
        ctx.j, ctx.scale = j, scale
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(q, mask, *kvs)
        return _step_attention(q, kvs, mask, j, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        q, mask, *kvs = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip([q, *kvs], [ctx.needs_input_grad[0],
                                                                                 *ctx.needs_input_grad[4:]])]
        kind, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
            out = _step_attention(inputs[0], tuple(inputs[1:]), mask, ctx.j, ctx.scale)
        wanted = [t for t in inputs if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        grads = [next(got) if t.requires_grad else None for t in inputs]
        return (grads[0], None, None, None, *grads[1:])


class UnrolledAttention:
    """Attention backend for the unroll: each layer's `cache` is a list collecting its K/V per step.

    Step j is one attention call per length bucket of the sequences (`PaddedLayout`: padded batches
    (B_b, L_b) holding under 2N rows in all). Its keys are step 0's K (positions 0..L_b-1) and, for each
    j' = 1..j, step j''s K moved down by j - j' positions within each sequence, so that position p of that
    copy holds the key at p - j + j'. An additive mask of (L_b, L_b (j + 1)), which depends on positions
    only and is built once per step and bucket length for every layer and sequence, lets query p see
    step-0 keys at positions <= p - j and in each copy only its own position, where p - j + j' >= 0. SDPA
    then runs its fused kernel (flash on CPU, memory-efficient on CUDA), which keeps no (H, n, n) scores
    for backward. What a layer keeps for backward (`_RecomputedStep`) is each step's padded queries and
    own K/V (shared by the later steps) and per step and bucket length the mask; `plan` counts them.
    On CPU the steps run as ttt_cpu.MergedStep instead: no mask, 2-4x less attention work, no recompute."""

    name = "unrolled"
    merged_on_cpu = True  # CPU: ttt_cpu.MergedStep (no mask, no recompute); tests switch it off to run the masked path
    expands_mla = True  # MLA heads run expanded here (models.deepseek_mla.MLAttention._expanded)

    def __init__(self) -> None:
        self.masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> None:
        return None

    def mask(self, j: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(L, L * (j + 1)) additive mask of step j (class docstring)."""
        key = (j, length, dtype)
        if key not in self.masks:
            pos = torch.arange(length, device=device)
            allowed = [pos[None, :] <= pos[:, None] - j]  # step-0 keys
            eye = torch.eye(length, dtype=torch.bool, device=device)
            allowed += [eye & (pos >= j - jp)[:, None] for jp in range(1, j + 1)]  # one key per copy
            self.masks[key] = additive_mask(torch.cat(allowed, dim=1), dtype)
        return self.masks[key]

    # Under train.compile this runs eagerly: bucket shapes change with every length mix (a recompile each) and
    # _RecomputedStep's backward calls autograd.grad, which does not trace; one graph break per layer and step.
    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: list,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        lay = padded_layout(meta)
        cache.append((lay.pad(k), lay.pad(v)))  # per bucket (B_b, L_b, Hkv, D)
        j = len(cache) - 1
        outs = []
        for b, qb in enumerate(lay.pad(q)):
            kvs = [t for kc, vc in cache for t in (kc[b], vc[b])]
            if q.device.type == "cpu" and self.merged_on_cpu:  # causal flash + the j diagonal keys, no recompute
                outs.append(MergedStep.apply(qb, j, scale, *kvs))
                continue
            mask = None if j == 0 else self.mask(j, qb.shape[1], q.dtype, q.device)
            outs.append(_RecomputedStep.apply(qb, mask, j, scale, *kvs))  # (B_b, L_b, H, D)
        return lay.unpad(outs)  # (N, H, D)


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


# Rows the greedy chain reaches (train.ttt_rows: reached). Under greedy verification the engine's draft j + 1 is
# verified only when drafts 1..j of its block were accepted, so only those states ever decide acceptance. Unrolled,
# step j at row p is draft j + 1 of the block that starts at row p - j (the module docstring); it is reached when
# step j - 1 at row p - 1 was reached and its greedy pick was the reference's next token there (t_{p+1}: in
# regenerated data, the target's own greedy token). Every row is a block start (step 0).


def check_ttt_rows(head_type: str, train: Any) -> None:
    """Refuse train.ttt_rows: reached where there is no chain to follow (a non-chain head, or one step)."""
    from headstart.errors import ConfigError
    from headstart.heads.config import CHAIN_HEADS

    if train.ttt_rows == "reached" and (head_type not in CHAIN_HEADS or train.ttt_steps < 2):
        raise ConfigError(f"train.ttt_rows: reached weighs the unrolled steps 2.. of a chain head (one of "
                          f"{', '.join(sorted(CHAIN_HEADS))}) with train.ttt_steps >= 2; this run has "
                          f"{head_type} with ttt_steps {train.ttt_steps}")


@torch.no_grad()
def reached_rows(head: DraftHead, outs: list[torch.Tensor], shifted: Shifted, chunk: int) -> list[torch.Tensor]:
    """(M,) bool per unrolled step, on the states' device: the rows the greedy chain reaches (above), from the
    head's greedy picks on the draft vocabulary (mapped to target ids) against the shifted next tokens. Nothing
    is read back to the host: the picks run on every row (the lm_head in row chunks of `chunk`, without
    gradient) and the chain is followed on the device; the loss takes the masks as row weights
    (losses.distill_steps)."""
    from headstart.heads.vocab import target_ids

    device = outs[0].device
    positions = packed_metadata(shifted.seq_lens, device=device).positions
    d2t = getattr(head, "d2t", None)
    ids = target_ids(d2t).to(device) if d2t is not None and d2t.numel() != head.target.vocab_size else None
    nxt = shifted.next_tokens.to(device, non_blocking=True)  # -100 where a row has no next token: never a hit
    reach = [torch.ones_like(positions, dtype=torch.bool)]
    for j in range(1, len(outs)):
        h = outs[j - 1].detach()
        pick = torch.cat([head.compute_logits(h[a:a + chunk]).argmax(-1) for a in range(0, max(h.shape[0], 1), chunk)])
        pick = ids[pick] if ids is not None else pick
        hit = reach[-1] & (pick == nxt)
        # row p - 1 of the same sequence (p's position >= j)
        reach.append(torch.roll(hit, 1) & (positions >= j))
    return reach
