"""nn.Linear with an optional single-row (GEMV) kernel for CPU decode.

Batch-1 decode is weight-streaming bound, and on CPU the stock kernel for the model's dtype is often
not the fastest way to stream the same weights (measured on the reference 2-core EPYC, 30 SmolLM2
layers + lm_head, one token: bf16 F.linear 19 ms vs 10 ms for the same weights as fp16; fp32
F.linear 45 ms vs 31 ms as `x @ W_t` with a pre-transposed copy). `enable_gemv()` keeps such a copy
and uses it for one-row inputs only; larger batches keep the native kernel, which wins there.

The fp16 copy of a bf16 weight is exact (fp16 has 3 more mantissa bits; values under 6e-5 become
fp16 subnormals with an absolute error below 3e-8, far under bf16's own rounding), activations are
cast bf16 -> fp16 -> bf16 around the matmul, so results agree with bf16 to bf16 precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_FP16_MAX = 65504.0


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._gemv: torch.Tensor | None = None
        self._gemv_kind = ""

    def enable_gemv(self) -> bool:
        """Prepare the one-row kernel for this weight's dtype; returns False if none applies."""
        w = self.weight.detach()
        if w.device.type != "cpu":
            return False
        if w.dtype == torch.bfloat16 and float(w.abs().max()) < _FP16_MAX:
            self._gemv, self._gemv_kind = w.to(torch.float16).contiguous(), "fp16"
        elif w.dtype == torch.float32:
            self._gemv, self._gemv_kind = w.t().contiguous(), "t"
        else:
            return False
        return True

    def disable_gemv(self) -> None:
        self._gemv, self._gemv_kind = None, ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv is None or x.dim() != 2 or x.shape[0] != 1:
            return F.linear(x, self.weight, self.bias)
        if self._gemv_kind == "fp16":
            y = F.linear(x.to(torch.float16), self._gemv).to(x.dtype)
        else:
            y = x @ self._gemv  # (1, in) @ (in, out)
        return y if self.bias is None else y + self.bias
