"""Count the host syncs of a piece of training code without a GPU.

A GPU step is paid in host syncs as much as in kernels: a scalar read (`.item()`, `float()`, `bool()`)
or a data-dependent shape (`nonzero`) makes the host wait for every queued kernel, and so do ops whose
CUDA kernels read a value back before they can size their output: `bincount` (min and max), boolean-mask
indexing and `masked_select` (a nonzero), `unique`, `repeat_interleave` without `output_size`, `equal`.
On CPU nothing waits, so this counts the ops that would: those whose input was computed on the device,
i.e. derived, op by op, from `roots` (a head's parameters, a batch's token ids and hidden states).
Host-side index work (loss masks, sequence lengths) is not counted. Limits: a tensor made from a host
value with `device=...` looks like host data here, and `Tensor.tolist` does not dispatch on CPU; on a
GPU, `torch.cuda.set_sync_debug_mode("warn")` sees every sync.

    counter = DeviceSyncCounter([*head.parameters(), batch.hidden])
    with counter:
        loss = step(batch)
    counter.syncs   # ['aten._local_scalar_dense.default', ...]
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
# ops that wait for the device whatever their arguments
_WAITS = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.item.default, _aten.is_nonzero.default,
          _aten.bincount.default, _aten.masked_select.default, _aten.equal.default, _aten._unique.default,
          _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default, _aten.allclose.default}
_REPEAT_INTERLEAVE = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}
_INDEXED = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


def _waits(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call reads a device value back on CUDA (module docstring)."""
    if func in _WAITS:
        return True
    if func in _REPEAT_INTERLEAVE:  # sized by the repeats' sum unless output_size (keyword-only) is given
        return kwargs.get("output_size") is None
    if func in _INDEXED:  # a boolean mask index is a nonzero (over-counts `x[mask] = scalar`: CUDA masked_fill_s it)
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())
    return False


class DeviceSyncCounter(TorchDispatchMode):
    def __init__(self, roots: Iterable[torch.Tensor | None]) -> None:
        super().__init__()
        self._device: dict[int, weakref.ref] = {}  # id -> weak reference (a tensor's == is elementwise)
        for t in roots:
            self._mark(t)
        self.syncs: list[str] = []

    def _mark(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self._device[id(t)] = weakref.ref(t)

    def _on_device(self, t: Any) -> bool:
        ref = self._device.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(self._on_device(t) for t in tree_leaves((args, kwargs))):
            if _waits(func, args, kwargs):
                self.syncs.append(str(func))
            for t in tree_leaves(out):
                self._mark(t)
        return out
