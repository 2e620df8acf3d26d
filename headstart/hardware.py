"""What the hardware computes natively, so `auto` precision never makes a run crawl.

bf16 is chosen only where the device computes it natively: CUDA GPUs, and CPUs with AVX-512 bf16
or AMX. On an AVX2-only CPU torch's bf16 matmul runs at ~0.3 GFLOP/s against ~156 for fp32
(2048² matmuls, Zen3, measured), so `auto` means fp32 there.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return any(f in flags for f in _NATIVE_BF16_FLAGS)


def native_bf16(device: str | torch.device = "cpu") -> bool:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> str:
    """'auto' -> 'bf16' where the device computes bf16 natively, else 'fp32'; other names unchanged."""
    if name != "auto":
        return name
    return "bf16" if native_bf16(device) else "fp32"


def resolve_precision(name: str, accelerator: str = "auto") -> str:
    """A Lightning precision string: 'auto' -> 'bf16-mixed' where bf16 is native, else '32-true'."""
    if name != "auto":
        return name
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    device = "cuda" if gpu else "cpu"
    return "bf16-mixed" if native_bf16(device) else "32-true"


def describe(device: str | torch.device = "cpu") -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"CUDA ({torch.cuda.get_device_name(dev)})"
    return "CPU with native bf16 (avx512_bf16/AMX)" if cpu_has_native_bf16() else "CPU without native bf16 (AVX2)"
