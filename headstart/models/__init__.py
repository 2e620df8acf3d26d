"""Target model families (one file each), weight loading, and `load_target`, which picks the family
from config.json's model_type."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from headstart.models.base import CausalLM
from headstart.models.llama import LlamaConfig, LlamaForCausalLM, load_llama
from headstart.nn.parallel import SINGLE, TensorParallel


def load_target(model_dir: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu",
                tp: TensorParallel = SINGLE, layers: Sequence[int] | None = None) -> CausalLM:
    """A target of any supported family (llama, mistral, qwen2, qwen3: headstart.models.llama;
    deepseek_v2, deepseek_v3: headstart.models.deepseek), loaded as load_llama does."""
    from headstart.models.deepseek import SUPPORTED_MODEL_TYPES as DEEPSEEK
    from headstart.models.llama import read_hf_config

    if read_hf_config(model_dir).get("model_type") in DEEPSEEK:
        from headstart.models.deepseek import load_deepseek

        return load_deepseek(model_dir, dtype, device, tp=tp, layers=layers)
    return load_llama(model_dir, dtype, device, tp=tp, layers=layers)


__all__ = ["CausalLM", "LlamaConfig", "LlamaForCausalLM", "load_llama", "load_target"]
