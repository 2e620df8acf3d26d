"""TTT step j's attention on CPU without a mask: the flash kernel's causal attention over step-0 keys merged
with the j single keys of the later steps by log-sum-exp (ttt.UnrolledAttention says what each row sees).

With a mask, step j's call scores every query against all L (j + 1) keys, though a query sees at most
p - j + 1 step-0 keys and j more: at j = 1 the masked call did ~4x the work of a causal one. Here

    causal   rows j..L-1 over step-0 keys 0..L-j-1 (row p sees 0..p-j: plain causal attention of the
             shifted queries), by ATen's CPU flash kernel, which also returns its log-sum-exp;
    diagonal for j' = 1..j the one key of step j''s copy at p - j + j' (where >= 0): a dot product per row;

and the output is their softmax-weighted merge. The backward pass is exact without rerunning anything: the
flash backward of the causal part, given the merged output and log-sum-exp, is the gradient of that part
of one softmax over all of a row's keys (as ring attention merges blocks), and the diagonal terms have a
closed form. Saved for backward: the queries, each step's own K/V, the merged output and its log-sum-exp.
"""

from __future__ import annotations

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _copy(t: torch.Tensor, shift: int, group: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, Hq, L, D): row p holds row p - shift (rolled within the padded row), KV heads
    repeated for their query heads."""
    return torch.roll(t, shift, dims=2).repeat_interleave(group, dim=1)


def _uncopy(t: torch.Tensor, shift: int, group: int) -> torch.Tensor:
    """The adjoint of _copy: (B, Hq, L, D) -> (B, Hkv, L, D)."""
    b, hq, n, d = t.shape
    return torch.roll(t.view(b, hq // group, group, n, d).sum(2), -shift, dims=2)


class MergedStep(torch.autograd.Function):
    """q (B, L, Hq, D), kvs = (K_0, V_0, ..., K_j, V_j) each (B, L, Hkv, D) -> (B, L, Hq, D)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, j: int, scale: float, *kvs: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        b, n, hq, d = q.shape
        group = hq // kvs[0].shape[2]
        qt = q.transpose(1, 2)  # (B, Hq, L, D)
        rows = torch.arange(n, device=q.device)
        parts_lse, parts_out = [], []
        if n > j:
            out_c, lse_c = _FLASH(qt[:, :, j:], kvs[0].transpose(1, 2)[:, :, :n - j],
                                  kvs[1].transpose(1, 2)[:, :, :n - j], 0.0, True, scale=scale)
            parts_lse.append(torch.nn.functional.pad(lse_c, (j, 0), value=float("-inf")))
            parts_out.append(torch.nn.functional.pad(out_c.float(), (0, 0, j, 0)))
        scores = []
        for jp in range(1, j + 1):
            k = _copy(kvs[2 * jp].transpose(1, 2), j - jp, group)
            s = (qt.float() * k.float()).sum(-1) * scale  # (B, Hq, L)
            s = s.masked_fill(rows < j - jp, float("-inf"))  # rolled in from the row's end: no key there
            scores.append(s)
            parts_lse.append(s)
            parts_out.append(_copy(kvs[2 * jp + 1].transpose(1, 2), j - jp, group).float())
        lse = torch.logsumexp(torch.stack(parts_lse), dim=0)  # (B, Hq, L): every row has its own key at least
        out = sum(torch.exp(pl - lse)[..., None] * po for pl, po in zip(parts_lse, parts_out))
        out = out.to(q.dtype)
        ctx.j, ctx.scale, ctx.group = j, scale, group
        ctx.save_for_backward(q, out, lse, *kvs, *scores)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        j, scale, group = ctx.j, ctx.scale, ctx.group
        q, out, lse, *rest = ctx.saved_tensors
        kvs, scores = rest[:2 * (j + 1)], rest[2 * (j + 1):]
        n = q.shape[1]
        qt, g = q.transpose(1, 2), grad.transpose(1, 2).to(q.dtype)  # (B, Hq, L, D)
        dq = torch.zeros(qt.shape, dtype=torch.float32, device=q.device)
        dkvs = [torch.zeros_like(t, dtype=torch.float32) for t in kvs]  # (B, L, Hkv, D)
        if n > j:
            k0, v0 = kvs[0].transpose(1, 2)[:, :, :n - j], kvs[1].transpose(1, 2)[:, :, :n - j]
            dqc, dk0, dv0 = _FLASH_BACKWARD(g[:, :, j:].contiguous(), qt[:, :, j:], k0, v0, out[:, :, j:],
                                            lse[:, :, j:], 0.0, True, scale=scale)
            dq[:, :, j:] += dqc.float()
            dkvs[0][:, :n - j] = dk0.transpose(1, 2).float()
            dkvs[1][:, :n - j] = dv0.transpose(1, 2).float()
        gf = g.float()
        row_dot = (gf * out.float()).sum(-1)  # (B, Hq, L): D_p of the softmax's backward
        for jp, s in zip(range(1, j + 1), scores):
            shift = j - jp
            p = torch.exp(s - lse)  # (B, Hq, L), 0 where no key
            v = _copy(kvs[2 * jp + 1].transpose(1, 2), shift, group).float()
            k = _copy(kvs[2 * jp].transpose(1, 2), shift, group).float()
            ds = p * ((gf * v).sum(-1) - row_dot) * scale
            dq += ds[..., None] * k
            dkvs[2 * jp] += _uncopy(ds[..., None] * qt.float(), shift, group).transpose(1, 2)
            dkvs[2 * jp + 1] += _uncopy(p[..., None] * gf, shift, group).transpose(1, 2)
        return (dq.transpose(1, 2).to(q.dtype), None, None, *(t.to(kv.dtype) for t, kv in zip(dkvs, kvs)))
