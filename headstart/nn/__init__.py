"""Shared building blocks: RMSNorm, RoPE, gated MLP, attention, decoder layer (one definition each)."""

from headstart.nn.attention import Attention, AttentionBackend
from headstart.nn.decoder import DecoderLayer, DecoderLayerConfig
from headstart.nn.mlp import GatedMLP
from headstart.nn.norm import RMSNorm
from headstart.nn.rope import RopeConfig, RotaryEmbedding

__all__ = [
    "Attention",
    "AttentionBackend",
    "DecoderLayer",
    "DecoderLayerConfig",
    "GatedMLP",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
]
