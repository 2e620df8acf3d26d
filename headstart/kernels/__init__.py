"""Row-invariant CPU kernels (rowwise.h; linear.cpp, attention.cpp, norm.cpp, module.cpp), compiled for this
CPU on first use.

`rowwise()` returns the compiled module, or None where it cannot be built (no C++ compiler, a
non-x86 CPU, `HEADSTART_KERNELS=0`); callers then keep torch's kernels, which are fast but give a
row different bits depending on how many rows share its matmul (see headstart.nn.linear). The
build (~30 s on 2 cores) is cached under `$HEADSTART_KERNEL_CACHE/<hash>` (default
`$HEADSTART_CACHE/kernels`), keyed by the sources, the torch version and the CPU's flags, so a machine
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

_HEADER = Path(__file__).with_name("rowwise.h")
_SOURCES = tuple(Path(__file__).with_name(n) for n in ("linear.cpp", "attention.cpp", "norm.cpp", "module.cpp"))
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


# -ffp-contract=off: the compiler never fuses a*b+c on its own, so every row's arithmetic is exactly
# what the source spells (explicit FMAs only); with "fast" the scalar tails of odd widths were fused
# in some code paths and not in others, and a row's bits depended on its tile (seen on Zen3 / AVX2).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")


def build_key() -> str:
    import torch

    h = hashlib.sha256()
    for path in (_HEADER, *_SOURCES):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(" ".join(CFLAGS).encode())
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


# How long a process waits for another one's build of the same kernels (~30 s on 2 cores) before
# it gives up and keeps torch's kernels.
LOCK_TIMEOUT_S = 300.0


def _build() -> Any:
    if os.environ.get("HEADSTART_KERNELS", "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        warnings.warn("headstart: row-invariant kernels are built for x86-64 only; using torch's", stacklevel=3)
        return None
    try:
        from headstart.assets import cache_dir

        key = build_key()
        root = Path(os.environ.get("HEADSTART_KERNEL_CACHE") or cache_dir() / "kernels").expanduser()
        return _cached_build(root, key)
    except Exception as e:  # noqa: BLE001 - any build failure leaves torch's kernels in place
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        warnings.warn(f"headstart: could not build the row-invariant CPU kernels ({type(e).__name__}: {reason}); "
                      "using torch's", stacklevel=4)
        return None


def _cached_build(root: Path, key: str) -> Any:
    """The module from `root/key`, healing the cache on the way.

    A build is trusted only when its `.so` matches the sha256 and size recorded after it was built
    (a truncated library would crash the process with a bus error on import); anything else is
    removed and built again. A valid build is imported without writing anything, so a read-only
    cache works; a read-only cache without one builds into a temporary directory for this process.
    Builds are serialised by an flock beside the build directory, which the kernel releases when
    its holder dies, so a killed build never blocks later ones (torch's own `lock` file would)."""
    from headstart.fileio import file_lock

    name = f"headstart_rowwise_{key}"
    build = root / key
    if _valid(build, name):
        return _import(build, name)
    try:
        build.mkdir(parents=True, exist_ok=True)
        writable = os.access(build, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix="headstart-kernels-"))
        warnings.warn(f"headstart: the kernel cache {root} is read-only and holds no valid build; building the "
                      f"kernels into {tmp} for this process", stacklevel=4)
        return _compile(name, tmp)
    with file_lock(root / f"{key}.lock", timeout=LOCK_TIMEOUT_S, what="the kernel build"):
        if _valid(build, name):  # built by the process we waited for
            return _import(build, name)
        import shutil

        # Ours alone (keyed by source, torch and CPU): a damaged .so, its objects and a stale torch
        # `lock` of a killed build all go, so the build starts clean.
        shutil.rmtree(build)
        build.mkdir()
        module = _compile(name, build)
        _record(build, name)
        return module


def _compile(name: str, build: Path) -> Any:
    from torch.utils.cpp_extension import load

    return load(name=name, sources=[str(p) for p in _SOURCES], build_directory=str(build),
                extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"], verbose=False)


def _record(build: Path, name: str) -> None:
    import json

    from headstart.fileio import atomic_write_text, sha256_file

    so = build / f"{name}.so"
    atomic_write_text(build / "checksum.json", json.dumps({"file": so.name, "size": so.stat().st_size,
                                                           "sha256": sha256_file(so)}))


def _valid(build: Path, name: str) -> bool:
    """The .so is the one recorded after its build (same size, same sha256)."""
    import json

    from headstart.fileio import sha256_file

    so = build / f"{name}.so"
    try:
        rec = json.loads((build / "checksum.json").read_text())
        return (isinstance(rec, dict) and so.stat().st_size == rec.get("size") and rec.get("size", 0) > 0
                and sha256_file(so) == rec.get("sha256"))
    except (OSError, ValueError):
        return False


def _import(build: Path, name: str) -> Any:
    """Import the built library as torch's loader would (module name = the extension's name)."""
    import importlib.util
    import sys

    import torch  # noqa: F401 - the library links against libtorch, which must be loaded first

    spec = importlib.util.spec_from_file_location(name, build / f"{name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


# Row counts up to which the row-invariant kernels serve a linear or a sequence's queries (decode,
# verify, tree and small chunks); bigger calls (prefill) keep torch's blocked kernels. Measured on a
# 2-core Zen4 (bf16): ours beats torch's F.linear for the 49152x576 lm_head at every M up to 33 and
# the 576x1536 layers up to ~24 rows; the limit is set where the invariance matters (B x (k + 1)).
MAX_ROWS = 64
# Without batch invariance (Engine(batch_invariant=False): regeneration, --no-batch-invariant) only
# calls this small take the row kernels: they stream a weight once per 4 rows, so at 8+ rows torch's
# blocked bf16 GEMM is faster (2-core Zen4, bf16, 2 threads: 576x1536 at 8 rows 112 vs 72 us, at 64
# rows 715 vs 149 us; the 49152x576 lm_head at 16 rows 10.7 vs 2.5 ms), while at 1-4 rows ours wins
# (1 row: 19 vs 74 us). It is also the query count up to which a sequence's attention takes the row kernel.
FAST_ROWS = 4
# Linears only, bf16 weights, by the instructions the linear kernel uses (linear_isa): AMX computes 16 rows
# per tile instruction, so ours stays ahead of torch's far longer. Every SmolLM2 linear in model order,
# 2-core Xeon with AMX, bf16 (benchmarks/kernels.py): torch / ours 2.43x at 1 row, 2.03x at 16, 1.53x at 32,
# 1.21x at 64, 1.01x at 96, 0.88x at 128. (Its AVX-512 bf16 path, HEADSTART_AMX=0, on the same Xeon: 1.28x at
# 8 rows, 0.82x at 16; a Zen4 lost at 8 rows already, so AVX-512 keeps FAST_ROWS.) `headstart regenerate`,
# 132 conversations at batch 64 on that Xeon: 41 s against 43 s at 4 rows.
FAST_LINEAR_ROWS = {"amx-bf16": 64}


def fast_linear_rows(dtype: Any) -> int:
    """Rows up to which a linear of this weight dtype takes the row kernel in an engine without batch
    invariance: FAST_LINEAR_ROWS for the ISA bf16 linears use here, else FAST_ROWS. HEADSTART_FAST_ROWS=N
    overrides it (tuning on another CPU; the A/B of benchmarks)."""
    import torch

    env = os.environ.get("HEADSTART_FAST_ROWS", "").strip()
    if env:
        if not (env.isascii() and env.isdigit()) or int(env) < 1:
            from headstart.errors import ConfigError

            raise ConfigError(f"HEADSTART_FAST_ROWS={env[:20]!r}: expected a row count >= 1")
        return int(env)
    mod = rowwise()
    if dtype != torch.bfloat16 or mod is None:
        return FAST_ROWS
    return FAST_LINEAR_ROWS.get(mod.linear_isa(), FAST_ROWS)


def inference_call(x: Any, weight: Any) -> bool:
    """A CPU call the inference kernels may serve: both tensors on the CPU, no gradient recorded for
    either, no autocast (training and autocast keep torch's ops and their numerics)."""
    import torch

    return (x.is_cpu and weight.is_cpu and not torch.is_autocast_enabled("cpu")
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


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
