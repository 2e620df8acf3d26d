"""The lossless acceptance rules of speculative decoding (docs/acceptance.md), as pure functions.

p = the target's processed distribution (temperature / top-k / top-p applied once, by the sampler),
q = the draft's distribution. Uniforms are float64 draws from the request's own generator.

- greedy:  accept x_i while x_i == argmax p_i; the bonus is argmax p at the stop point.
- one-hot: (drafts chosen independently of the verifier's draws, e.g. argmax of q)
           accept x with probability p(x); on rejection sample from p with x removed, renormalised.
- full-q:  (drafts sampled from q) accept x if u <= min(1, p(x)/q(x)); on rejection sample from
           norm(max(0, p - q)); if all k pass, the bonus is sampled from p_{k+1}.
- tree:    one-hot per candidate: try the children in order; accept child c with probability p'(c),
           p' = p with the already-rejected siblings removed and renormalised; if all fail, sample
           from the final p'.
Trap (tested to be detected): accepting with min(1, p/q) but subtracting q only at x in the residual.

`verify_chain` applies the chain rules (greedy, one-hot, full-q) to a whole batch with tensor ops on
the logits' device, from uniforms drawn up front (k + 1 per sequence per step), so a sampled
verify step needs one host synchronisation however many sequences and drafts it has. The
per-sequence functions are the rules' reference definitions (and the tree rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    accepted: int  # draft tokens accepted (bonus excluded)
    tokens: list[int]  # accepted drafts followed by the bonus / correction token


def _uniform(gen: torch.Generator | None) -> float:
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def _sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """Inverse CDF with one float64 uniform; probs need not be normalised."""
    positive = torch.nonzero(probs > 0)
    if positive.numel() == 0 or not bool(torch.isfinite(probs).all()):
        raise ValueError("cannot sample: the distribution has no positive finite probability (all zero or "
                         "NaN); check the sampling parameters (temperature, top-p/top-k/min-p) and the logits")
    cdf = probs.double().cumsum(0)
    u = _uniform(gen) * float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    return min(idx, int(positive[-1]))


def verify_greedy(drafts: list[int], p: torch.Tensor | list[int]) -> Verdict:
    """p (k+1, V), or its row argmaxes already on the host: accept while draft == argmax; no random
    draw is consumed."""
    best = p.argmax(-1).tolist() if isinstance(p, torch.Tensor) else p
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return Verdict(a, drafts[:a] + [best[a]])


def verify_one_hot(drafts: list[int], p: torch.Tensor, gen: torch.Generator | None) -> Verdict:
    for i, x in enumerate(drafts):
        px = float(p[i, x])
        if _uniform(gen) < px:
            continue
        residual = p[i].clone()
        residual[x] = 0.0
        return Verdict(i, drafts[:i] + [_sample(residual, gen)])
    return Verdict(len(drafts), drafts + [_sample(p[len(drafts)], gen)])


def verify_full_q(drafts: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None) -> Verdict:
    """q (k, V) the distributions the drafts were sampled from; p (k+1, V)."""
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i, x])
        if qx > 0 and _uniform(gen) <= min(1.0, px / qx):
            continue
        residual = (p[i].double() - q[i].double()).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p[i].double()
        return Verdict(i, drafts[:i] + [_sample(residual, gen)])
    return Verdict(len(drafts), drafts + [_sample(p[len(drafts)], gen)])


def verify_chain(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, u: torch.Tensor,
                 greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain rules for a batch, without a host synchronisation.

    drafts (B, k) long; p (B, k+1, V) the processed target distributions; q (B, k, V) the draft
    distributions when the drafts were sampled from them (full-q rule), else None (one-hot rule);
    u (B, k+1) float64 uniforms of each request's own generator: u[:, i] decides draft i, u[:, k]
    draws the correction (or the bonus); rows where `greedy` (B,) bool is set take the greedy rule.
    Returns accepted (B,), tokens (B, k+1) (the drafts, then the correction / bonus at index
    `accepted`; later entries are unused) and ok (B,) bool: the distribution drawn from had
    positive finite mass (else the caller raises, as `_sample` does).
    """
    b, k = drafts.shape
    rows = torch.arange(b, device=p.device)
    px = p[:, :k].gather(2, drafts.unsqueeze(-1)).squeeze(-1).double()  # (B, k)
    if q is None:
        accept = u[:, :k] < px
    else:  # u <= min(1, p/q)  <=>  u * q <= p  for q > 0 and u in [0, 1)
        qx = q.gather(2, drafts.unsqueeze(-1)).squeeze(-1).double()
        accept = (qx > 0) & (u[:, :k] * qx <= px)
    best = p.argmax(-1)  # (B, k+1)
    accept = torch.where(greedy.unsqueeze(1), drafts == best[:, :k], accept)
    a = accept.long().cumprod(1).sum(1)  # leading accepted drafts
    stop = p[rows, a].double()  # (B, V): the row after the last accepted draft
    rejected = (a < k).unsqueeze(1)
    at = a.clamp(max=k - 1)
    if q is None:  # one-hot: p with the rejected draft removed
        drop = torch.nn.functional.one_hot(drafts[rows, at], stop.shape[1]).bool() & rejected
        dist = stop.masked_fill(drop, 0.0)
    else:  # full-q: norm(max(0, p - q)); p itself when p == q up to rounding
        diff = (stop - q[rows, at].double()).clamp(min=0.0)
        diff = torch.where(diff.sum(1, keepdim=True) > 0, diff, stop)
        dist = torch.where(rejected, diff, stop)
    positive = dist > 0
    ok = positive.any(1) & torch.isfinite(dist).all(1)
    cdf = dist.cumsum(1)
    idx = torch.searchsorted(cdf, (u[:, k] * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    last = dist.shape[1] - 1 - positive.flip(1).long().argmax(1)  # the last token with mass
    drawn = torch.minimum(idx, last)
    token = torch.where(greedy, best[rows, a], drawn)
    tokens = torch.cat([drafts, drafts.new_zeros(b, 1)], 1).scatter(1, a.unsqueeze(1), token.unsqueeze(1))
    return a, tokens, ok


def verify_mixed_biased(drafts: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None) -> Verdict:
    """The biased rule (min(1, p/q) acceptance, residual with q removed at x only). Kept only so a
    test can show that the distribution check catches it; never used by the engine."""
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i, x])
        if qx > 0 and _uniform(gen) <= min(1.0, px / qx):
            continue
        residual = p[i].double().clone()
        residual[x] = max(0.0, float(residual[x]) - qx)
        return Verdict(i, drafts[:i] + [_sample(residual, gen)])
    return Verdict(len(drafts), drafts + [_sample(p[len(drafts)], gen)])


def verify_tree(children: list[list[int]], tokens: list[int], p: torch.Tensor, greedy: bool,
                gen: torch.Generator | None) -> tuple[list[int], list[int]]:
    """A draft tree verified in one pass.

    children[n]: child node ids of node n in try order (node 0 is the root = the last committed
    token); tokens[n]: the token of node n; p (num_nodes, V): the target distribution after node n.
    Returns (accepted node path excluding the root, emitted tokens = their tokens + the bonus).
    """
    node, path = 0, []
    while True:
        pn = p[node].double().clone()
        nxt = None
        for c in children[node]:
            x = tokens[c]
            if greedy:
                if int(pn.argmax()) == x:
                    nxt = c
                    break
                continue
            total = float(pn.sum())
            if total > 0 and _uniform(gen) < float(pn[x]) / total:
                nxt = c
                break
            pn[x] = 0.0  # p' : the rejected sibling removed (renormalised implicitly)
        if nxt is None:
            bonus = int(pn.argmax()) if greedy else _sample(pn if float(pn.sum()) > 0 else p[node].double(), gen)
            return path, [tokens[n] for n in path] + [bonus]
        path.append(nxt)
        node = nxt
