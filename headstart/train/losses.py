"""Distillation losses (docs/training.md, Losses), computed in row chunks so that no [tokens x vocab] tensor
outlives its chunk: each chunk's logits are recomputed in the backward pass (activation
checkpointing), so peak memory is set by `chunk` rows, not by the batch.

    kl       forward KL(p || q): p = softmax(lm_head(norm(h_target))) recomputed from the stored
             pre-norm hidden state through the frozen final norm and lm_head; q = the head's.
             With a reduced draft vocabulary, p is restricted to it and renormalised.
    feature  smooth-L1 between the head's output and the target's next hidden state, in the head's
             feature space (mtp: pre-norm h; eagle1: post-norm h), both divided by the target row's RMS.
    LK       (train.loss: lk_alpha / lk_lambda; arXiv 2602.23881) the acceptance rate of a draft sampled
             from q, a = sum_x min(p(x), q(x)) = 1 - TV(p, q), trained directly: per row a (and -log a),
             summed like the KL. With a draft vocabulary p is the target's full distribution read on the
             draft tokens, not renormalised: the target's mass outside them is never accepted (the KL
             keeps the renormalised p_d). `objective` combines the sums (module.HeadModule).

Per-step statistics (no gradient), over supervised rows: top-1 agreement with the target's argmax
(a greedy draft is accepted under greedy verification iff the two agree), the acceptance of a draft
sampled from q under the full-q rule, sum_x min(p(x), q(x)), and the target's probability mass
inside the draft vocabulary (1 without one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from headstart.heads.base import DraftHead


@dataclass
class LossParts:
    kl: torch.Tensor  # summed over supervised rows (differentiable)
    feature: torch.Tensor  # summed over supervised rows and dims (differentiable)
    rows: int  # supervised rows
    alpha: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # sum of a = sum_x min(p, q) (LK only)
    neglog_alpha: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # sum of -log a (LK only)
    correct: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # top-1 agreements (no grad)
    accept: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # sum of min(p, q) (no grad)
    mass: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # target mass inside the draft vocab


def target_logits(head: DraftHead, target_h: torch.Tensor) -> torch.Tensor:
    """(R, d) pre-norm target states -> (R, V) fp32 logits through the frozen norm and lm_head."""
    return head.target.lm_head(head.target.norm(target_h.to(head.target.lm_head.weight.dtype))).float()


class _ForwardKL(torch.autograd.Function):
    """sum over rows of w_r KL(p_r || softmax(logits_r)); its gradient, w (softmax(logits) - p), is
    written out so the backward makes two passes over the (R, V) chunk instead of autograd's chain of five."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, logp: torch.Tensor, p: torch.Tensor,  # noqa: ANN001
                w: torch.Tensor) -> torch.Tensor:
        logq = torch.log_softmax(logits, dim=-1)
        ctx.save_for_backward(logq, p, w)  # p: one tensor shared by every step's KL of the chunk
        return (w[:, None] * p * (logp - logq)).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: ANN001
        logq, p, w = ctx.saved_tensors
        return grad * w[:, None] * (logq.exp() - p), None, None, None


ALPHA_FLOOR = 1e-8  # -log a of a row whose acceptance underflows is -log of this (and has no gradient)


class _Acceptance(torch.autograd.Function):
    """[sum_r w_r a_r, sum_r w_r (-log a_r)] with a_r = sum_x min(p_rx, softmax(logits_r)_x). The gradient
    of a through the softmax, q (m - sum(m q)) with m = [q < p], is written out: two (R, V) passes, no
    chain of autograd nodes over the chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        q = torch.softmax(logits, dim=-1)
        a = torch.minimum(p, q).sum(-1)
        floor = a.clamp(min=ALPHA_FLOOR)
        ctx.save_for_backward(q, p, w, a)
        return torch.stack([(w * a).sum(), -(w * floor.log()).sum()])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        q, p, w, a = ctx.saved_tensors
        m = (q < p).to(q.dtype)
        da = q * (m - (m * q).sum(-1, keepdim=True))  # d a_r / d logits_r
        coef = w * (grad[0] - torch.where(a >= ALPHA_FLOOR, grad[1] / a.clamp(min=ALPHA_FLOOR), 0.0))
        return coef[:, None] * da, None, None


def _chunk_kl(head: DraftHead, draft_ids: torch.Tensor | None, target_h: torch.Tensor, weights: torch.Tensor,
              stats: list, lk: bool, *head_h: torch.Tensor) -> torch.Tensor:
    """The weighted KL of one chunk of rows at every step -> (S, 3): [KL, sum of a, sum of -log a] (the
    last two with `lk`, else zeros), from one teacher distribution for the
    chunk's rows, read by each of the S steps' head states `head_h` (R, d), row r of step s weighted
    weights[s, r] (1 if supervised there, else 0). Checkpointed: it runs again in the backward pass,
    where `stats` (filled by the first run, per step: top-1 agreements, sum of min(p, q), target mass
    inside the draft vocabulary) is already set and not recomputed. A caller that wants no statistics
    passes [None] (they cost ~10% of the step).

    With a draft vocabulary the teacher is the target's distribution restricted to the V_d draft
    tokens and renormalised, p_d(x) = p(x) / p(V_d). Forward KL(p_d || q) is a proper objective: it
    is minimised exactly at q = p_d, and p_d is also the q that maximises the acceptance of drafts
    sampled from q, sum_x min(p(x), q(x)) = p(V_d), the most any q on V_d can reach. Its logits need
    only the V_d lm_head rows (the full-vocabulary normaliser cancels), so the teacher's side costs
    V_d rows too; the full vocabulary is computed only when statistics or the LK losses (whose p is not
    renormalised) ask for it."""
    want = not stats
    logp, p, top, p_full = _teacher(head, draft_ids, target_h, want or lk, top=want)
    kls = []
    none = torch.zeros(2, device=target_h.device)
    for w, hh in zip(weights, head_h):
        logits = head.compute_logits(hh)  # (R, V or Vd) fp32
        if want:
            with torch.no_grad():
                q = torch.softmax(logits.detach(), dim=-1)
                pick = q.argmax(-1)
                correct = ((pick if draft_ids is None else draft_ids[pick]) == top).float()
                stats.append(torch.stack([(w * correct).sum(), (w * torch.minimum(p_full, q).sum(-1)).sum(),
                                          (w * p_full.sum(-1)).sum()]))
        acc = _Acceptance.apply(logits, p_full, w) if lk else none
        kls.append(torch.cat([_ForwardKL.apply(logits, logp, p, w)[None], acc]))
    return torch.stack(kls)


@torch.no_grad()
def _teacher(head: DraftHead, draft_ids: torch.Tensor | None, target_h: torch.Tensor, full: bool,
             top: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A chunk's teacher: (log p, p) over the draft vocabulary, renormalised (only its V_d lm_head rows are
    computed unless `full`), with `full` also the target's full-vocabulary p read on the draft tokens, not
    renormalised (statistics, LK), and with `top` the target's argmax over the full vocabulary; else None for
    those."""
    if draft_ids is not None and not full:
        t_logits = restricted_target_logits(head, target_h)  # (R, Vd)
    else:
        t_logits = target_logits(head, target_h)  # (R, V)
    argmax = p_full = None
    if full:
        argmax = t_logits.argmax(-1) if top else None
        p_full = torch.softmax(t_logits, dim=-1)
        if draft_ids is not None:
            p_full, t_logits = p_full[:, draft_ids], t_logits[:, draft_ids]  # renormalised below
    logp = torch.log_softmax(t_logits, dim=-1)
    return logp, logp.exp(), argmax, p_full


def restricted_target_logits(head: DraftHead, target_h: torch.Tensor) -> torch.Tensor:
    """(R, d) pre-norm target states -> (R, Vd) fp32 target logits of the draft vocabulary's tokens."""
    from headstart.heads.vocab import restricted_lm_head

    lin = restricted_lm_head(head.target, head.target.lm_head, head.d2t)
    return lin(head.target.norm(target_h.to(lin.weight.dtype))).float()


def distill(head: DraftHead, head_h: torch.Tensor, target_h: torch.Tensor, rows: torch.Tensor,
            feature_target: torch.Tensor | None, chunk: int, with_kl: bool = True,
            with_stats: bool = True, lk: bool = False) -> LossParts:
    """Losses over `rows` (indices of supervised rows) of head_h (M, d) against target_h (M, d)."""
    return distill_steps(head, [head_h], target_h, [rows], feature_target, chunk, with_kl, with_stats, lk)[0]


def objective(part: LossParts, loss: str, kl_scale: float = 1.0, kl_decay: float = 3.0) -> torch.Tensor:
    """One step's distribution loss per supervised row (train.loss): kl, lk_alpha (mean -log a) or
    lk_lambda / lk (l KL + (1 - l)(1 - mean a), l = kl_scale * exp(-kl_decay * mean a), l without gradient)."""
    n = max(part.rows, 1)
    if loss == "kl":
        return part.kl / n
    if loss == "lk_alpha":
        return part.neglog_alpha / n
    if not part.rows:  # nothing supervised: no loss (kl, alpha are zeros still tied to the graph)
        return part.kl + part.alpha
    mean_a = part.alpha / n
    lam = kl_scale * torch.exp(-kl_decay * mean_a.detach())
    return lam * part.kl / n + (1 - lam) * (1 - mean_a)


def distill_steps(head: DraftHead, head_h: list[torch.Tensor], target_h: torch.Tensor, rows: list[torch.Tensor],
                  feature_target: torch.Tensor | None, chunk: int, with_kl: bool = True,
                  with_stats: bool = True, lk: bool = False, grads: tuple[int, ...] | None = None,
                  row_weights: list[torch.Tensor] | None = None) -> list[LossParts]:
    """The losses of S steps that share their targets (the unrolled TTT steps: step s's head states
    head_h[s] (M, d) against the same target rows target_h (M, d)), over each step's supervised rows
    rows[s] (host-side indices, so that nothing here waits for the device). The teacher distribution
    of a row is computed once for every step that supervises it (and once more in the backward pass),
    not once per step. Rows run in chunks of `chunk`; with no row, one empty chunk still runs the
    lm_head (a DDP rank must use every parameter, whatever its data). `grads` names the components of each
    step's [KL, sum of a, sum of -log a] a backward may reach (grad_components(train.loss); default all
    that are computed): the fused path keeps only their gradients. `row_weights` (per step an (M,) device
    tensor, train.ttt_rows: reached) weighs each step's rows in every sum while its row count stays
    len(rows[s]): a 0/1 mask makes a step's per-row mean the mean over the kept rows times the fraction kept,
    without reading the mask back to the host."""
    device = target_h.device
    zero = sum(h.sum() for h in head_h) * 0.0  # keeps the graph connected when a batch has no supervised row
    counts = [int(r.numel()) for r in rows]  # host tensors: no sync
    union = torch.unique(torch.cat([r.cpu() for r in rows])) if len(rows) > 1 else rows[0].cpu()
    pieces = [torch.arange(a, min(a + chunk, union.numel())) for a in range(0, union.numel(), chunk)]
    pieces = pieces or [torch.arange(0)]  # no row: the lm_head still runs, on none
    # (S, U) 1 where step s supervises union row u: a weight, so every step runs the same rows.
    member = torch.stack([torch.isin(union, r.cpu()) for r in rows]).float().to(device, non_blocking=True)
    union_d = union.to(device, non_blocking=True)
    if row_weights is not None:
        member = member * torch.stack([w[union_d].to(member.dtype) for w in row_weights])
    d2t = getattr(head, "d2t", None)
    draft_ids = None
    if d2t is not None and d2t.numel() != head.target.vocab_size:
        draft_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t  # draft id i -> target id i + d2t[i]
    kl = torch.zeros(len(rows), 3, device=device) + zero
    stats_sum = torch.zeros(len(rows), 3, device=device)
    wants_grad = torch.is_grad_enabled() and any(h.requires_grad for h in head_h)
    proj = fused_projection(head, device) if with_kl and wants_grad else None
    if proj is not None:  # the gradient taken in the forward pass: no chunk computed twice (FusedChunks)
        pre, weight = proj
        got: list = []
        comps = grads if grads is not None else (0, 1, 2) if lk else (0,)
        if not lk and set(comps) - {0}:
            raise ValueError(f"grads {comps}: components 1 and 2 (a, -log a) need lk")
        kl = kl + FusedChunks.apply(weight, head, draft_ids, target_h[union_d], member, pieces, with_stats, lk, comps,
                                    got,
                                    *(pre(h[union_d]) for h in head_h))
        if with_stats:
            stats_sum = stats_sum + torch.stack(got)
    elif with_kl:
        for piece in pieces:
            piece = piece.to(device, non_blocking=True)
            r, w = union_d[piece], member[:, piece]
            hh, th = [h[r] for h in head_h], target_h[r]
            stats: list = [] if with_stats else [None]
            if torch.is_grad_enabled() and any(h.requires_grad for h in hh):
                k = checkpoint(_chunk_kl, head, draft_ids, th, w, stats, lk, *hh, use_reentrant=False)
            else:
                k = _chunk_kl(head, draft_ids, th, w, stats, lk, *hh)
            kl = kl + k
            if with_stats:
                stats_sum = stats_sum + torch.stack(stats)
    feats = [zero] * len(rows)
    if feature_target is not None and union.numel():
        # In units of the target row's RMS: pre-norm states carry outlier dimensions hundreds of times
        # larger than the rest, which would otherwise dominate the loss and its gradient.
        t = feature_target[union_d].float()
        scale = t.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-6)
        feats = [(w[:, None] * F.smooth_l1_loss(h[union_d].float() / scale, t / scale, reduction="none")).sum()
                 for w, h in zip(member, head_h)]
    parts = []
    for s, n in enumerate(counts):
        part = LossParts(kl[s, 0], feats[s], n, alpha=kl[s, 1], neglog_alpha=kl[s, 2])
        if with_stats:
            part.correct, part.accept, part.mass = stats_sum[s].detach().unbind()
        parts.append(part)
    return parts


# The fused chunks: the chunked distillation loss with its gradient taken in the forward pass (CPU, heads
# whose logits are one Linear of their own: `DraftHead.logit_projection`).
#
# distill_steps checkpoints each chunk: its forward computes the teacher and every step's logits and
# throws them away, and the backward pass computes them all again to differentiate them. Here each chunk is
# computed once: the loss's gradient with respect to the logits has a closed form (KL: w (q - p); LK:
# losses._Acceptance's), so the forward pass goes on to the gradients of the projection's input rows and
# weight at once, for a unit upstream gradient of each output, and keeps only those (rows x d and V x d per
# step, not rows x V). The backward pass scales them by the upstream gradient: the losses are linear in
# it, whatever `objective` later makes of the steps (TTT decay, per-row means, LK's lambda).


class FusedChunks(torch.autograd.Function):
    """(weight (V, d), *z) -> (S, 3) [KL, sum of a, sum of -log a] per step, as losses._chunk_kl's sums over
    the chunks: z[s] (U, d) are step s's projection inputs of the union rows, `pieces` the chunks of them,
    member (S, U) the steps' row weights. `stats` (a list) receives per step [top-1 agreements, sum of
    min(p, q), target mass in the draft vocabulary] when `with_stats`."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, head: object, draft_ids: torch.Tensor | None,  # noqa: ANN001
                target_h: torch.Tensor, member: torch.Tensor, pieces: list[torch.Tensor], with_stats: bool,
                lk: bool, comps: tuple[int, ...], stats: list, *z: torch.Tensor) -> torch.Tensor:
        device = weight.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight.dtype
        w_c = weight.detach().to(dtype)  # the cast a Linear under autocast makes, once per micro-batch
        dz = [torch.zeros((len(comps), *t.shape), dtype=torch.float32, device=device) for t in z]
        dw = torch.zeros((len(z), len(comps), *weight.shape), dtype=torch.float32, device=device)
        out = torch.zeros(len(z), 3, device=device)
        sums = torch.zeros(len(z), 3, device=device)
        for piece in pieces:
            piece = piece.to(device)
            th, w_rows = target_h[piece], member[:, piece]
            full = with_stats or lk
            logp, p, top, p_full = _teacher(head, draft_ids, th, full, top=with_stats)
            for s, zs in enumerate(z):
                w = w_rows[s]
                zc = zs[piece].detach().to(dtype)
                logq = torch.log_softmax((zc @ w_c.t()).float(), dim=-1)
                q = logq.exp()
                out[s, 0] += (w[:, None] * p * (logp - logq)).sum()
                grads = {0: q.sub(p).mul_(w[:, None])} if 0 in comps else {}  # d KL / d logits
                if full:
                    a = torch.minimum(p_full, q).sum(-1)
                if with_stats:
                    pick = q.argmax(-1)
                    correct = ((pick if draft_ids is None else draft_ids[pick]) == top).float()
                    sums[s] += torch.stack([(w * correct).sum(), (w * a).sum(), (w * p_full.sum(-1)).sum()])
                if lk:
                    out[s, 1] += (w * a).sum()
                    out[s, 2] -= (w * a.clamp(min=ALPHA_FLOOR).log()).sum()
                    if 1 in comps or 2 in comps:
                        m = (q < p_full).to(q.dtype)
                        da = q * (m - (m * q).sum(-1, keepdim=True))  # d a / d logits
                    if 1 in comps:
                        grads[1] = w[:, None] * da
                    if 2 in comps:
                        inv = torch.where(a >= ALPHA_FLOOR, 1 / a.clamp(min=ALPHA_FLOOR), 0.0)
                        grads[2] = (-w * inv)[:, None] * da
                for c, g in enumerate(grads[i] for i in comps):
                    g = g.to(dtype)
                    dz[s][c, piece] = (g @ w_c).float()
                    dw[s, c] += (g.t() @ zc).float()
        if with_stats:
            stats.extend(sums.unbind())
        ctx.comps = list(comps)
        ctx.save_for_backward(dw, *dz)
        ctx.dtypes = (weight.dtype, [t.dtype for t in z])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        dw, *dz = ctx.saved_tensors
        if grad[:, [c for c in range(3) if c not in ctx.comps]].any():
            raise RuntimeError(f"FusedChunks kept the gradients of components {ctx.comps} only (the objective's, "
                               "sizing.grad_components); the loss used another")
        g = grad[:, ctx.comps].float()  # (S, comps)
        d_weight = (g[:, :, None, None] * dw).sum((0, 1)).to(ctx.dtypes[0])
        d_z = [(g[s][:, None, None] * t).sum(0).to(dt) for s, (t, dt) in enumerate(zip(dz, ctx.dtypes[1]))]
        return (d_weight, None, None, None, None, None, None, None, None, None, *d_z)


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
