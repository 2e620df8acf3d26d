"""The routed experts of a mixture-of-experts MLP, their weights stacked: one grouped matmul per projection.

`RoutedExperts` holds `gate_up_proj.weight` (E, 2I, D) and `down_proj.weight` (E, D, I): expert e's fused
gate/up and down projections are slice e (checkpoints name them `experts.{e}.gate_proj` / `up_proj` /
`down_proj`; the loader and the export layouts stack and unstack them). A forward takes each token's k
expert ids and weights and returns the weighted sum of its experts' outputs:

- **grouped** (training, and inference without the CPU kernels): the (token, slot) pairs sorted by expert,
  one `torch._grouped_mm` per projection over the sorted rows with the group ends computed on the device
  (no host sync, a fixed number of kernels whatever the routing), one `index_add_` back to the tokens. Under
  autocast (bf16-mixed training, fp32 master weights under DDP) the operands are cast to autocast's dtype,
  as autocast casts a Linear's, so the grouped form runs there too.
  Every expert takes part in the graph, an idle one on no rows, so every rank's backward reaches every
  expert weight (DDP's reducer, FSDP's reduce-scatter) whichever experts its tokens chose. Where
  `_grouped_mm` does not run (CUDA before sm90, or not bf16 there) the same sums are made one expert
  at a time, with one host sync for the group sizes.
- **per expert, row-invariant** (the engine on CPU, after `enable_cpu_kernels`): the group sizes are read
  on the host (free on a CPU), idle experts are skipped, and each expert's rows go through a Linear
  over its slice with the row-invariant kernel, so a token's bits do not depend on what shares its step.

Either way a token sums its experts in expert order (the sort is stable and `index_add_` on CPU adds
duplicate indices in order): the grouped and the per-expert forms give the same bits at fp32 on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from headstart.nn.linear import Linear, weight_version


class StackedWeight(nn.Module):
    """E weights of one projection, (E, out, in), each initialised as nn.Linear initialises its own."""

    def __init__(self, experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        if self.weight.device.type != "meta":
            bound = 1 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) of an (out, in) weight
            nn.init.uniform_(self.weight, -bound, bound)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on for x's device (bf16-mixed training
    keeps fp32 master weights and may hand fp32 activations in), else x's."""
    kind = x.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def grouped_mm_runs(x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether `torch._grouped_mm` runs for these activations computed in `dtype` (default x's): on CPU at
    any float dtype, on CUDA in bf16 from sm90 (Hopper) on."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        return (dtype or x.dtype) == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


class RoutedExperts(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int, act) -> None:  # noqa: ANN001
        super().__init__()
        self.num_experts, self.intermediate, self.act = experts, intermediate, act
        self.gate_up_proj = StackedWeight(experts, hidden, 2 * intermediate)
        self.down_proj = StackedWeight(experts, intermediate, hidden)
        self._register_load_state_dict_pre_hook(_stack_per_expert_keys, with_module=True)

    def own_cpu_kernels(self, rowwise: bool, max_rows: int | None) -> list[str]:
        """A Linear per expert and projection over its slice of the stacked weight (a view: no copy beyond what
        the kernel packs), with the CPU kernels; used by no-grad forwards while the weights are unchanged."""
        gu, down = self.gate_up_proj.weight.detach(), self.down_proj.weight.detach()
        lins: list[tuple[Linear, Linear]] = []
        for e in range(self.num_experts):
            with torch.device("meta"):  # built without weights of their own: each takes its slice (a view)
                a, b = Linear(gu.shape[2], gu.shape[1], bias=False), Linear(down.shape[2], down.shape[1], bias=False)
            a.weight, b.weight = nn.Parameter(gu[e], requires_grad=False), nn.Parameter(down[e], requires_grad=False)
            lins.append((a, b))
        got = [lin.enable_cpu_kernels(rowwise, max_rows) for pair in lins for lin in pair]
        object.__setattr__(self, "_per_expert", (weight_version(self.gate_up_proj.weight),
                                                 weight_version(self.down_proj.weight), lins))
        return got

    def _kernels(self) -> list[tuple[Linear, Linear]] | None:
        own = self.__dict__.get("_per_expert")
        if own is None or torch.is_grad_enabled() or own[:2] != (weight_version(self.gate_up_proj.weight),
                                                                  weight_version(self.down_proj.weight)):
            return None
        return own[2]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (N, D), weights (N, k), expert ids (N, k) -> (N, D) in x's dtype."""
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        tokens, w = order // k, weights.flatten()[order]
        # tokens per expert by a scatter, not torch.bincount: on CUDA bincount reads its input's min and max
        # back to the host (a sync per call); a scatter into E counters stays on the device
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        kernels = self._kernels()
        dtype = compute_dtype(x)
        if kernels is None and grouped_mm_runs(x, dtype):
            # _grouped_mm is not an autocast op: the operands are cast here as autocast casts F.linear's
            ends = counts.cumsum(0).to(torch.int32)
            gu, down = (p.weight.to(dtype).transpose(-2, -1) for p in (self.gate_up_proj, self.down_proj))
            h = torch._grouped_mm(x[tokens].to(dtype), gu, offs=ends)
            gate, up = h.split(self.intermediate, dim=-1)
            a = (self.act(gate) * up).to(dtype)
            del h, gate, up  # not needed by the weighting below (autograd keeps what it saved)
            y = torch._grouped_mm(a, down, offs=ends)
            del a
            return torch.zeros_like(x).index_add_(0, tokens, (y * w[:, None]).to(x.dtype))
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts.tolist()):
            if not count and not torch.is_grad_enabled():
                continue  # inference skips an idle expert; with gradients it runs on no rows (module docstring)
            rows = tokens[start:start + count]
            if kernels is not None:
                gate, up = kernels[e][0](x[rows]).split(self.intermediate, dim=-1)
                y = kernels[e][1](self.act(gate) * up)
            else:
                gate, up = F.linear(x[rows], self.gate_up_proj.weight[e]).split(self.intermediate, dim=-1)
                y = F.linear(self.act(gate) * up, self.down_proj.weight[e])
            out.index_add_(0, rows, (y * w[start:start + count, None]).to(out.dtype))
            start += count
        return out


def _stack_per_expert_keys(module: RoutedExperts, state: dict, prefix: str, *args) -> None:  # noqa: ANN002
    """A state dict saved with one module per expert (`{prefix}{e}.gate_up_proj.weight`, headstart before the
    experts were stacked) loads into the stacked weights."""
    for proj in ("gate_up_proj", "down_proj"):
        keys = [f"{prefix}{e}.{proj}.weight" for e in range(module.num_experts)]
        if f"{prefix}{proj}.weight" not in state and all(key in state for key in keys):
            state[f"{prefix}{proj}.weight"] = torch.stack([state.pop(key) for key in keys])
