"""The chunked distillation loss with its gradient taken in the forward pass (CPU, heads whose logits are
one Linear of their own: `DraftHead.logit_projection`).

losses.distill_steps checkpoints each chunk: its forward computes the teacher and every step's logits and
throws them away, and the backward pass computes them all again to differentiate them. Here each chunk is
computed once: the loss's gradient with respect to the logits has a closed form (KL: w (q - p); LK:
losses._Acceptance's), so the forward pass goes on to the gradients of the projection's input rows and
weight at once, for a unit upstream gradient of each output, and keeps only those (rows x d and V x d per
step, not rows x V). The backward pass scales them by the upstream gradient: the losses are linear in
it, whatever `objective` later makes of the steps (TTT decay, per-row means, LK's lambda).
"""

from __future__ import annotations

import torch

from headstart.train import losses


class FusedChunks(torch.autograd.Function):
    """(weight (V, d), *z) -> (S, 3) [KL, sum of a, sum of -log a] per step, as losses._chunk_kl's sums over
    the chunks: z[s] (U, d) are step s's projection inputs of the union rows, `pieces` the chunks of them,
    member (S, U) the steps' row weights. `stats` (a list) receives per step [top-1 agreements, sum of
    min(p, q), target mass in the draft vocabulary] when `with_stats`."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, head: object, draft_ids: torch.Tensor | None,  # noqa: ANN001
                target_h: torch.Tensor, member: torch.Tensor, pieces: list[torch.Tensor], with_stats: bool,
                lk: bool, stats: list, *z: torch.Tensor) -> torch.Tensor:
        device = weight.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight.dtype
        w_c = weight.detach().to(dtype)  # the cast a Linear under autocast makes, once per micro-batch
        comps = 3 if lk else 1
        dz = [torch.zeros((comps, *t.shape), dtype=torch.float32, device=device) for t in z]
        dw = torch.zeros((len(z), comps, *weight.shape), dtype=torch.float32, device=device)
        out = torch.zeros(len(z), 3, device=device)
        sums = torch.zeros(len(z), 3, device=device)
        for piece in pieces:
            piece = piece.to(device)
            th, w_rows = target_h[piece], member[:, piece]
            full = with_stats or lk
            t_logits = losses.restricted_target_logits(head, th) if draft_ids is not None and not full else \
                losses.target_logits(head, th)
            if full:
                top = t_logits.argmax(-1)
                p_full = torch.softmax(t_logits, dim=-1)
                if draft_ids is not None:
                    p_full, t_logits = p_full[:, draft_ids], t_logits[:, draft_ids]
            logp = torch.log_softmax(t_logits, dim=-1)
            p = logp.exp()
            del t_logits
            for s, zs in enumerate(z):
                w = w_rows[s]
                zc = zs[piece].detach().to(dtype)
                logq = torch.log_softmax((zc @ w_c.t()).float(), dim=-1)
                q = logq.exp()
                out[s, 0] += (w[:, None] * p * (logp - logq)).sum()
                grads = [q.sub(p).mul_(w[:, None])]  # d KL / d logits
                if full:
                    a = torch.minimum(p_full, q).sum(-1)
                if with_stats:
                    pick = q.argmax(-1)
                    correct = ((pick if draft_ids is None else draft_ids[pick]) == top).float()
                    sums[s] += torch.stack([(w * correct).sum(), (w * a).sum(), (w * p_full.sum(-1)).sum()])
                if lk:
                    out[s, 1] += (w * a).sum()
                    out[s, 2] -= (w * a.clamp(min=losses.ALPHA_FLOOR).log()).sum()
                    m = (q < p_full).to(q.dtype)
                    da = q * (m - (m * q).sum(-1, keepdim=True))  # d a / d logits
                    inv = torch.where(a >= losses.ALPHA_FLOOR, 1 / a.clamp(min=losses.ALPHA_FLOOR), 0.0)
                    grads += [w[:, None] * da, (-w * inv)[:, None] * da]
                for c, g in enumerate(grads):
                    g = g.to(dtype)
                    dz[s][c, piece] = (g @ w_c).float()
                    dw[s, c] += (g.t() @ zc).float()
        if with_stats:
            stats.extend(sums.unbind())
        ctx.comps = comps
        ctx.save_for_backward(dw, *dz)
        ctx.dtypes = (weight.dtype, [t.dtype for t in z])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        dw, *dz = ctx.saved_tensors
        g = grad[:, :ctx.comps].float()  # (S, comps)
        d_weight = (g[:, :, None, None] * dw).sum((0, 1)).to(ctx.dtypes[0])
        d_z = [(g[s][:, None, None] * t).sum(0).to(dt) for s, (t, dt) in enumerate(zip(dz, ctx.dtypes[1]))]
        return (d_weight, None, None, None, None, None, None, None, None, *d_z)


def fused_projection(head: object, device: torch.device) -> tuple | None:
    """(pre, weight) of the head's logits (compute_logits(h) == linear(pre(h), weight)) where the fused path
    runs: on CPU, for a trained projection of the head's own that is a plain tensor. Under FSDP2 the losses
    run inside the root's forward (module.HeadStep), where fully_shard has swapped the unsharded plain
    parameters in: the fused path runs there too, and its gradient reaches the unsharded weight's .grad,
    which FSDP reduce-scatters (tests/test_fused_corners.py). A still-sharded DTensor weight (a call
    outside the root's forward) takes the checkpointed chunks."""
    if device.type != "cpu" or not hasattr(head, "logit_projection"):
        return None
    proj = head.logit_projection()
    if proj is None:
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed tensors has no FSDP2 either
        return proj
    return None if isinstance(proj[1], DTensor) else proj
