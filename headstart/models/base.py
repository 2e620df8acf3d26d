"""What every target model family shares: the frozen pieces heads read (embedding, final norm,
lm_head), logits, the weight fingerprint, CPU kernels, partial loading (AbsentLayer).

A family's model (headstart.models.llama, headstart.models.deepseek) sets `config` (the whole
model's, with vocab_size, hidden_size, num_hidden_layers, max_position_embeddings, eos_token_ids),
`model` (a backbone with embed_tokens, layers, norm) and `lm_head`, and implements `forward`
(flat tokens over a paged KV cache -> pre-norm last hidden state and captured aux states) and the
cache layout the engine allocates (cache_heads, cache_head_dim, cache_shared).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headstart.models.loading import safetensors_files
from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.linear import enable_cpu_kernels
from headstart.nn.parallel import SINGLE, TensorParallel


class AbsentLayer(nn.Module):
    """A decoder layer a partial model did not load (see `load_llama(..., layers=)`): it holds no
    weights, and a forward through it is refused."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(f"decoder layer {self.index} was not loaded: this partial target (the frozen pieces a "
                           "head trains against) cannot run a forward")


# RopeConfig fields added after fingerprints were recorded, with the value every earlier model had.
LATER_ROPE_FIELDS = {"interleaved": False}


class CausalLM(nn.Module):
    """Base of the target families (see the module docstring)."""

    # Config fields added after fingerprints were recorded, with the value every earlier model had.
    later_fields: dict[str, Any] = {}

    def __init__(self, cfg: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.source_dir: Path | None = None  # set by the loader; used for the weight fingerprint
        self._fingerprint: str | None = None
        # The whole model's typical last-hidden-state RMS, for a partial model that cannot measure it.
        self.state_rms: float | None = None

    # The paged KV cache per layer: `cache_heads` x `cache_head_dim` per token, and whether keys and
    # values are one tensor (MLA's latent) or two.
    cache_shared = False

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def partial(self) -> bool:
        """True for a model loaded with only some of its decoder layers (no forward)."""
        return any(isinstance(layer, AbsentLayer) for layer in self.model.layers)

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list[KVPages], backend: AttentionBackend,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids (N,) -> h (N, D) pre-norm last hidden state, {j: (N, D) hidden state entering layer j}."""
        cfg = self.config
        backend.plan(meta, self.num_local_heads, self.cache_heads, self.cache_head_dim, self.dtype)
        h = self.embed(input_ids)
        aux: dict[int, torch.Tensor] = {}
        for j, layer in enumerate(self.model.layers):
            if j in capture:
                aux[j] = h
            h = layer(h, meta, caches[j], backend)
        if cfg.num_hidden_layers in capture:
            aux[cfg.num_hidden_layers] = h
        return h, aux

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, D)
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """h (N, D) pre-norm -> logits (R, V) in fp32, for `rows` only if given."""
        if rows is not None:
            h = h[rows]
        return self.lm_head(self.model.norm(h)).float()

    def fingerprint(self) -> str:
        """sha256 over the config and the weight files (computed once); identifies the target a head,
        a manifest or a checkpoint was made with."""
        if self._fingerprint is None:
            fields = dataclasses.asdict(self.config)
            rope = fields.get("rope")
            for key, default in LATER_ROPE_FIELDS.items():  # RopeConfig fields added later, hashed only where set
                if isinstance(rope, dict) and rope.get(key) == default:
                    rope.pop(key)
            for key, default in self.later_fields.items():  # hashed only where set: older fingerprints stay valid
                if fields.get(key) == default:
                    fields.pop(key)
            h = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
            if self.source_dir is None and self.tp.enabled:
                raise ValueError("a tensor-parallel shard built in memory has no fingerprint of the whole model; "
                                 "load it from its weight files (load_llama(..., tp=...))")
            if self.source_dir is not None:
                for f in safetensors_files(self.source_dir):
                    h.update(f.name.encode())
                    with open(f, "rb") as fh:
                        while block := fh.read(1 << 24):
                            h.update(block)
            else:  # built in memory: hash the weights themselves
                for name, t in sorted(self.state_dict().items()):
                    h.update(name.encode())
                    h.update(t.detach().float().cpu().numpy().tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def enable_cpu_kernels(self, rowwise: bool = True, max_rows: int | None = None) -> list[str]:
        """CPU inference kernels for every linear (see headstart.nn.linear); returns what each got."""
        return enable_cpu_kernels(self, rowwise, max_rows)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype


def materialise(model: CausalLM, device: str | torch.device, dtype: torch.dtype,
                layers: Sequence[int] | None = None) -> CausalLM:
    """A model built on the meta device -> empty tensors on `device` in `dtype`, ready for load_weights.
    With `layers`, only those decoder layers are kept (the others become AbsentLayer: a partial model);
    tied embeddings are tied again (to_empty unties them)."""
    if layers is not None:
        if model.tp.enabled:
            raise ValueError("a partial model (layers=) is loaded whole, not as a tensor-parallel shard")
        n = model.config.num_hidden_layers
        keep = {j % n for j in layers}
        for j in range(n):
            if j not in keep:
                model.model.layers[j] = AbsentLayer(j)
    model = model.to_empty(device=device).to(dtype)  # rotary tables are rebuilt in fp32 on the way
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
