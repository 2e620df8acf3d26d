"""Tiny random HF models of every supported family, saved as safetensors directories."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "llama-tied", "llama-bias"]


def hf_config(family: str, vocab_size: int = 320, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  eos_token_id=1, bos_token_id=0)
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if family == "llama-bias":  # q/k/v/o and MLP biases (HF LlamaConfig attention_bias / mlp_bias)
        return LlamaConfig(**{**common, "attention_bias": True, "mlp_bias": True}, tie_word_embeddings=False)
    if family == "llama-tied":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if family == "llama3-rope":
        return LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0})
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=24, tie_word_embeddings=False)
    raise ValueError(family)


def make_hf_model(family: str, path: Path, seed: int = 0, vocab_size: int = 320, **overrides):
    """Build, randomise (scaled so logits are well separated) and save; returns the HF model.
    `overrides`: config fields that differ from the family's tiny defaults (e.g. num_key_value_heads)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norm weights
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return model
