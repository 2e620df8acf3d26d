"""Rotary position embeddings: default, linear, Llama-3 and YaRN scaling (one implementation).

HF "rotate_half" convention: the head dimension is split in two halves (x1, x2) and rotated as
(x1·cos − x2·sin, x2·cos + x1·sin) with frequencies repeated over both halves. `interleaved`
(DeepSeek): the pairs are (x0, x1), (x2, x3), ...; they are rotated the same way and written out
in the half-split layout (as HF's DeepSeek-V3 does), which only reorders dimensions that q and k
share. YaRN multiplies cos and sin by its attention factor (the "mscale").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(kw_only=True)
class RopeConfig:
    head_dim: int
    theta: float = 10000.0
    max_positions: int = 4096
    scaling: dict[str, Any] = field(default_factory=dict)  # HF rope_scaling / rope_parameters minus theta
    partial_rotary_factor: float = 1.0
    interleaved: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], head_dim: int) -> RopeConfig:
        """Read both the transformers-4 (`rope_theta` + `rope_scaling`) and -5 (`rope_parameters`) spellings."""
        params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling.update(params)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(f"unsupported RoPE scaling {kind!r}; supported: default, linear, llama3, yarn")
        return cls(
            head_dim=head_dim, theta=float(theta), max_positions=int(cfg.get("max_position_embeddings", 4096)),
            scaling=scaling if kind != "default" else {},
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
        )


def _inv_freq(cfg: RopeConfig) -> torch.Tensor:
    dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    inv = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = cfg.scaling.get("rope_type", cfg.scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / cfg.scaling["factor"]
    elif kind == "llama3":
        factor = cfg.scaling["factor"]
        low, high = cfg.scaling["low_freq_factor"], cfg.scaling["high_freq_factor"]
        old_ctx = cfg.scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn_inv_freq(cfg, inv, dim)
    return inv


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale`: 0.1 · mscale · ln(scale) + 1 (1 below scale 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: RopeConfig, inv: torch.Tensor, dim: int) -> torch.Tensor:
    """YaRN (arXiv:2309.00071): frequencies that turn fewer than beta_slow times over the original
    context are interpolated by `factor`, those turning more than beta_fast times kept, with a
    linear ramp between (over dimension indices, rounded outward unless truncate is false)."""
    sc = cfg.scaling
    factor = float(sc["factor"])
    old_ctx = sc["original_max_position_embeddings"]
    fast, slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low, high = dim_of(fast), dim_of(slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv / factor * (1 - keep) + inv * keep


def attention_factor(cfg: RopeConfig) -> float:
    """What YaRN multiplies cos and sin by (1 for the other kinds)."""
    sc = cfg.scaling
    if sc.get("rope_type", sc.get("type")) != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = float(sc["factor"])
    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return yarn_mscale(factor, sc["mscale"]) / yarn_mscale(factor, sc["mscale_all_dim"])
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (no per-step trigonometry)."""

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.rot_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        cos, sin = self._tables(None)  # None: the default device (meta inside a meta-device context)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        inv = _inv_freq(self.cfg)
        inv = inv if device is None else inv.to(device)
        t = torch.arange(self.cfg.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)  # (P, rot/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, rot)
        scale = attention_factor(self.cfg)
        return emb.cos() * scale, emb.sin() * scale

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        # Follow device moves, but keep the tables in fp32 when the model is cast to bf16/fp16, and
        # recompute them when the module was built on the meta device.
        super()._apply(fn, recurse)
        if self.cos.device.type != "meta":
            self.cos, self.sin = self._tables(self.cos.device)
        return self

    def tables(self, positions: torch.Tensor, dtype: torch.dtype,
               cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, 1, rot) for these positions in `dtype`; memoised in `cache` (one step's dict)
        so the 30 layers of a model gather and cast them once per step, not once per layer."""
        key = ("rope", id(self), dtype)
        if cache is not None and key in cache:
            return cache[key]
        # Tables are fp32; the rotation runs in the activation dtype, as HF does (bf16 parity).
        out = (self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))
        if cache is not None:
            cache[key] = out
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q (N, Hq, Dh), k (N, Hk, Dh), positions (N,) -> rotated q, k (same dtype).

        q and k are rotated in one pass (concatenated over heads): half the small ops per layer."""
        cos, sin = self.tables(positions, q.dtype, cache)
        hq = q.shape[1]
        rotate = _rotate_pairs if self.cfg.interleaved else _rotate
        qk = rotate(torch.cat([q, k], dim=1), cos, sin, self.rot_dim)
        return qk[:, :hq], qk[:, hq:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    xr = x[..., :rot]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos + rotated * sin
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3), ... rotated, written out half-split."""
    if rot != x.shape[-1]:
        raise ValueError("interleaved RoPE rotates the whole head dimension")
    half = rot // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
