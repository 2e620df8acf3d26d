"""nn.Linear with CPU inference kernels for the few-row matmuls of decode and verify steps.

`enable_cpu_kernels()` picks, for a CPU weight:
- the row-invariant kernel (headstart.kernels, bf16 / fp32 weights) for inputs of up to
  `MAX_ROWS` rows: every output row is computed the same way whether it is alone or one of many,
  which is what makes greedy speculative output equal greedy AR output; it reads a copy of the
  weight packed once for it (outputs across vector lanes), streamed once for all rows, so a 4-row
  verify costs little more than one row (benchmarks/cpu_kernels.py);
- where that kernel cannot be built, a one-row (GEMV) copy of the weight: bf16 weights as fp16 (the
  copy is exact; fp16 has 3 more mantissa bits; values under 6e-5 become fp16 subnormals with an
  absolute error below 3e-8), fp32 weights pre-transposed; faster for batch-1 decode, but rows then
  differ with the batch size.
Training never enables them, and a forward that records gradients always takes F.linear.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from headstart.kernels import MAX_ROWS, inference_call, kernel_dtype_ok, rowwise
from headstart.nn.norm import RMSNorm

_FP16_MAX = 65504.0


def weight_version(w: torch.Tensor) -> tuple[int, int]:
    """What identifies a weight's current values: its storage and in-place version (a load or an optimizer
    step changes it; inference tensors keep no version counter and are never trained: their storage is their
    identity). Derived copies (a packed kernel layout, per-head or per-expert Linears) are rebuilt when it moves."""
    return w.data_ptr(), -1 if w.is_inference() else w._version


def init_like_linear(weight: torch.Tensor) -> None:
    """nn.Linear's default initialisation, for weights held outside a Linear (torch.empty is whatever the
    allocator returns: a head built without the target's weights trained on NaN or 1e34 entries)."""
    if weight.device.type != "meta":
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._gemv: torch.Tensor | None = None
        self._gemv_kind = ""
        self._rows = 0  # inputs of up to this many rows take the row-invariant kernel (0: never)
        self._packed: torch.Tensor | None = None  # the weight in that kernel's layout
        self._packed_of: tuple[int, int] = (-1, -1)  # (data_ptr, _version) of the weight it was packed from

    def enable_cpu_kernels(self, rowwise_kernels: bool = True, max_rows: int | None = MAX_ROWS) -> str:
        """Use the fastest CPU inference kernel available for this weight; returns which ("rows",
        "gemv" or "" for none). max_rows=None sends every input through the row-invariant kernel
        (batch-invariant prefill too; a 600-token SmolLM2 prefill costs 1.4x (bf16) to 1.8x (fp32)
        torch's on a 2-core Zen4)."""
        w = self.weight.detach()
        if w.device.type != "cpu":
            return ""
        if rowwise_kernels and kernel_dtype_ok(w.dtype) and rowwise() is not None:
            self._rows, self._gemv, self._gemv_kind = 1 << 62 if max_rows is None else max_rows, None, ""
            self._pack(force=True)  # a weight changed without a version bump (fused AdamW, .data) is read anew
            return "rows"
        if w.dtype == torch.bfloat16 and float(w.abs().max()) < _FP16_MAX:
            self._gemv, self._gemv_kind = w.to(torch.float16).contiguous(), "fp16"
        elif w.dtype == torch.float32:
            self._gemv, self._gemv_kind = w.t().contiguous(), "t"
        else:
            return ""
        return "gemv"

    def disable_cpu_kernels(self) -> None:
        self._gemv, self._gemv_kind, self._rows, self._packed = None, "", 0, None

    def _pack(self, force: bool = False) -> torch.Tensor:
        """The weight in the row kernel's layout, packed again whenever the weight was replaced or
        changed in place since (an optimizer step between two validations), as far as its version
        counter tells: writes through `.data`, fused optimizers and in-place changes of inference
        tensors do not bump it, which is why `enable_cpu_kernels` always packs anew."""
        w = self.weight
        of = weight_version(w)
        if force or self._packed is None or self._packed_of != of:
            self._packed, self._packed_of = rowwise().pack_linear(w.detach()), of
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not self._rows and self._gemv is None) or x.dim() != 2 or not inference_call(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        if self._rows:
            if x.shape[0] <= self._rows and x.dtype == self.weight.dtype:
                return rowwise().linear_packed(x, self._pack(), self.out_features, self.in_features, self.bias)
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] != 1:
            return F.linear(x, self.weight, self.bias)
        if self._gemv_kind == "fp16":
            y = F.linear(x.to(torch.float16), self._gemv).to(x.dtype)
        else:
            y = x @ self._gemv  # (1, in) @ (in, out)
        return y if self.bias is None else y + self.bias


def enable_cpu_kernels(module: nn.Module, rowwise_kernels: bool = True, max_rows: int | None = MAX_ROWS) -> list[str]:
    """enable_cpu_kernels on every Linear of a module, and on the derived ones of modules that keep
    their own (`own_cpu_kernels`: e.g. MLA's per-head absorbed projections); returns what each got.
    Its RMSNorms take the row-wise norm kernel with the row-invariant linears (headstart.nn.norm)."""
    got: list[str] = []
    for m in module.modules():
        if isinstance(m, Linear):
            got.append(m.enable_cpu_kernels(rowwise_kernels, max_rows))
        elif isinstance(m, RMSNorm):
            m.enable_cpu_kernels(rowwise_kernels)
        elif hasattr(m, "own_cpu_kernels"):
            got.extend(m.own_cpu_kernels(rowwise_kernels, max_rows))
    return got


@contextlib.contextmanager
def cpu_kernels_restored(module: nn.Module) -> Iterator[None]:
    """Run a block (e.g. an Engine over a model that training keeps using) and put every Linear's
    and RMSNorm's kernel choice back as it was afterwards."""
    saved = [(m, m._rows, m._gemv, m._gemv_kind, m._packed, m._packed_of) for m in module.modules()
             if isinstance(m, Linear)]
    norms = [(m, m._kernel) for m in module.modules() if isinstance(m, RMSNorm)]
    try:
        yield
    finally:
        for m, rows, gemv, kind, packed, packed_of in saved:
            m._rows, m._gemv, m._gemv_kind, m._packed, m._packed_of = rows, gemv, kind, packed, packed_of
        for m, kernel in norms:
            m._kernel = kernel
