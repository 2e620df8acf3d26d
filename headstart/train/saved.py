"""What autograd keeps for the backward pass of a piece of training code, in bytes: the distinct storages
its saved tensors live in, parameters left out (they are held anyway). `plan`'s activation terms
(`headstart.plan.ACTIVATION_TERMS`) count the same thing for one micro-batch.

    with SavedBytes(head, target) as kept:
        loss, _ = module.losses(batch)
    kept.bytes
"""

from __future__ import annotations

import torch
from torch import nn


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, *modules: nn.Module) -> None:
        params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self._storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                self._storages[st.data_ptr()] = st.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self) -> SavedBytes:
        super().__enter__()
        return self

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())
