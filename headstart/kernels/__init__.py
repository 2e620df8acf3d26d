"""Row-invariant CPU kernels (rowwise.cpp), compiled for this CPU on first use.

`rowwise()` returns the compiled module, or None where it cannot be built (no C++ compiler, a
non-x86 CPU, `HEADSTART_KERNELS=0`); callers then keep torch's kernels, which are fast but give a
row different bits depending on how many rows share its matmul (see headstart.nn.linear). The
build (~30 s on 2 cores) is cached under `$HEADSTART_KERNEL_CACHE/<hash>` (default
`$HEADSTART_CACHE/kernels`), keyed by the source, the torch version and the CPU's flags, so a machine
with other vector units never reuses it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path
from typing import Any

_SOURCE = Path(__file__).with_name("rowwise.cpp")
_lock = threading.Lock()
_module: Any = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    import torch

    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def rowwise() -> Any:
    """The compiled kernels, or None (the reason is warned once). Callers in other threads wait for
    a build in progress rather than fall back to torch's kernels for part of a model."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if not _tried:
            _module = _build()
            _tried = True
        return _module


def _build() -> Any:
    if os.environ.get("HEADSTART_KERNELS", "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        warnings.warn("headstart: row-invariant kernels are built for x86-64 only; using torch's", stacklevel=3)
        return None
    try:
        from torch.utils.cpp_extension import load

        from headstart.assets import cache_dir

        key = build_key()
        build = Path(os.environ.get("HEADSTART_KERNEL_CACHE") or cache_dir() / "kernels").expanduser() / key
        build.mkdir(parents=True, exist_ok=True)
        return load(name=f"headstart_rowwise_{key}", sources=[str(_SOURCE)], build_directory=str(build),
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure leaves torch's kernels in place
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        warnings.warn(f"headstart: could not build the row-invariant CPU kernels ({type(e).__name__}: {reason}); "
                      "using torch's", stacklevel=3)
        return None


# Row counts up to which the row-invariant kernels serve a linear or a sequence's queries (decode,
# verify, tree and small chunks); bigger calls (prefill) keep torch's blocked kernels. Measured on a
# 2-core Zen4 (bf16): ours beats torch's F.linear for the 49152x576 lm_head at every M up to 33 and
# the 576x1536 layers up to ~24 rows; the limit is set where the invariance matters (B x (k + 1)).
MAX_ROWS = 64


def kernel_dtype_ok(dtype: Any) -> bool:
    import torch

    return dtype in (torch.bfloat16, torch.float32)


def mask_key_sets(mask: Any) -> tuple[list[int], list[list[int]]]:
    """A boolean mask (q_len, kv_len) as, per row, the length of its leading run of visible keys
    and the indices of the visible keys after it (tree ancestors)."""
    import torch

    m = mask.to("cpu", torch.bool)
    lead = m.to(torch.int32).cumprod(1).sum(1)
    rest = m.clone()
    cols = torch.arange(m.shape[1]).unsqueeze(0)
    rest &= cols >= lead.unsqueeze(1)
    extras = [torch.nonzero(r).flatten().tolist() for r in rest]
    return lead.tolist(), extras
