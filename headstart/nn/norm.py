"""RMSNorm, computed in fp32 and cast back (the same numerics as HF's LlamaRMSNorm).

`enable_cpu_kernels()` (the engine calls it with the linears') sends CPU inference through the
row-wise kernel (headstart.kernels, norm.cpp): one pass per row instead of seven small torch ops
(cast, square, mean, add, rsqrt, product, cast) and their temporaries, for every row count. Both
give a row the same bits whatever shares its call; they differ in the square sum's order, so the
kernel moves the last bit of a few rows (0.1 % of SmolLM2's bf16 norm rows, ~20 % in fp32), and
greedy continuations can then differ from torch's / HF's, as the row-invariant linears' already do.
Training never takes it: a forward that records gradients, runs under autocast, mixes dtypes or
uses one the kernel does not compute keeps the torch formula below.
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.kernels import inference_call, kernel_dtype_ok, rowwise


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._kernel = False

    def enable_cpu_kernels(self, rowwise_kernels: bool = True) -> str:
        """The row-wise kernel for CPU inference where it is built; returns "rows" or "" (torch's ops)."""
        w = self.weight
        self._kernel = bool(rowwise_kernels and w.device.type == "cpu" and kernel_dtype_ok(w.dtype)
                            and rowwise() is not None)
        return "rows" if self._kernel else ""

    def disable_cpu_kernels(self) -> None:
        self._kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
        w = self.weight
        if self._kernel and x.dtype == w.dtype and kernel_dtype_ok(x.dtype) and inference_call(x, w):
            return rowwise().rms_norm_rows(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
