"""Count the host syncs of a piece of training code without a GPU.

A GPU step is paid in host syncs as much as in kernels: a scalar read (`.item()`, `float()`, `bool()`)
or a data-dependent shape (`nonzero`) makes the host wait for every queued kernel. On CPU nothing
waits, so this counts the ops that would: those whose input was computed on the device, i.e. derived,
op by op, from `roots` (a head's parameters, a batch's token ids and hidden states). Host-side index
work (loss masks, sequence lengths) is not counted. Limits: a tensor made from a host value with
`device=...` looks like host data here, and `Tensor.tolist` does not dispatch on CPU; on a GPU,
`torch.cuda.set_sync_debug_mode("warn")` sees every sync.

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

_WAITS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.item.default}


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
        out = func(*args, **(kwargs or {}))
        if any(self._on_device(t) for t in tree_leaves((args, kwargs))):
            if func in _WAITS:
                self.syncs.append(str(func))
            for t in tree_leaves(out):
                self._mark(t)
        return out
