"""The Llama family in one file: Llama 2/3 (incl. Llama-3 RoPE scaling), Mistral, Qwen2 (qkv bias),
Qwen3 (q/k norm), SmolLM2. Tied or untied embeddings, GQA.

The forward runs over a flat batch of tokens and a paged KV cache (see headstart.nn.attention) and
returns the hidden state of the last decoder layer BEFORE the final norm, plus, on request, the
hidden states ENTERING chosen layers (docs/architecture.md: aux layer j = HF `hidden_states[j]`, j = 0 is
the embedding output). `compute_logits(h, rows)` applies the final norm and lm_head, only at `rows`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headstart.errors import AssetError
from headstart.models.base import CausalLM, materialise
from headstart.models.loading import check_sizes, fp8_block_size, load_weights
from headstart.nn.decoder import DecoderLayer, DecoderLayerConfig
from headstart.nn.norm import RMSNorm
from headstart.nn.parallel import SINGLE, TensorParallel, VocabParallelEmbedding, VocabParallelLinear
from headstart.nn.rope import RopeConfig, RotaryEmbedding

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# LlamaConfig fields added after heads and shards recorded target fingerprints, with the value every
# earlier model had: a model at that value keeps its fingerprint.
_LATER_FIELDS = {"o_proj_bias": False}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(kw_only=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    attention_bias: bool = False  # qkv bias (Qwen2 always)
    o_proj_bias: bool = False  # Llama / Qwen3 with attention_bias: o_proj has one too (Qwen2 never)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    rope: RopeConfig | None = None
    sliding_window: int | None = None  # Mistral: the engine caps the context at the window (no SWA kernel)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json") -> LlamaConfig:
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise AssetError(
                f"{where}: model_type {mt!r} is not supported by headstart.models.llama "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        check_sizes(cfg, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
                    ("num_key_value_heads", "head_dim", "max_position_embeddings"), where)
        heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        if heads % kv:
            raise AssetError(f"{where}: num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv} "
                             "(each key/value head serves a whole group of query heads); the config.json is damaged")
        if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
            raise AssetError(f"{where}: hidden_size = {cfg['hidden_size']} is not a multiple of num_attention_heads "
                             f"= {heads} and no head_dim is given; the config.json is damaged")
        try:
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
            eos = cfg.get("eos_token_id")
            out = cls(
                model_type=mt,
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                hidden_act=cfg.get("hidden_act", "silu"),
                attention_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_proj_bias=mt != "qwen2" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=mt == "qwen3",
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                bos_token_id=cfg.get("bos_token_id"),
                sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            )
            out.rope = RopeConfig.from_hf(cfg, head_dim)
        except KeyError as e:
            raise AssetError(f"{where}: missing key {e.args[0]!r}") from None
        except ValueError as e:
            raise AssetError(f"{where}: {e}") from None
        return out

    def layer_config(self) -> DecoderLayerConfig:
        return DecoderLayerConfig(
            hidden=self.hidden_size, intermediate=self.intermediate_size, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim, norm_eps=self.rms_norm_eps,
            act=self.hidden_act, qkv_bias=self.attention_bias, qk_norm=self.qk_norm, mlp_bias=self.mlp_bias,
            o_bias=self.o_proj_bias,
        )


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer_config(), self.rotary, tp)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """A target model. Parameter names follow HF's, with q/k/v and gate/up fused.

    With `tp` (headstart.nn.parallel) the model holds one rank's shard: its q/KV heads, its share of
    the MLP and of the vocabulary; `config` stays the whole model's, and every forward returns whole
    hidden states and logits on every rank."""

    later_fields = _LATER_FIELDS

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, tp)
        self.model = LlamaBackbone(cfg, tp)
        self.lm_head = VocabParallelLinear(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _a_layer(self) -> DecoderLayer | None:
        return next((layer for layer in self.model.layers if isinstance(layer, DecoderLayer)), None)

    @property
    def num_local_heads(self) -> int:
        """q heads this rank computes (all of them without tensor parallelism)."""
        layer = self._a_layer()
        return layer.self_attn.num_heads if layer is not None else self.config.num_attention_heads

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank caches (all of them without tensor parallelism)."""
        layer = self._a_layer()
        return layer.self_attn.num_kv_heads if layer is not None else self.config.num_key_value_heads

    @property
    def cache_heads(self) -> int:
        return self.num_local_kv_heads

    @property
    def cache_head_dim(self) -> int:
        return self.config.head_dim

    def packed_names(self) -> dict[str, tuple[str, int, list[int]]]:
        """HF fragment -> (our fused parameter, block, block sizes): this rank's sizes under tensor parallelism."""
        c = self.config
        q, kv = self.num_local_heads * c.head_dim, self.num_local_kv_heads * c.head_dim
        layer = self._a_layer()
        inter = layer.mlp.intermediate if layer is not None else c.intermediate_size
        return {
            "q_proj": ("qkv_proj", 0, [q, kv, kv]),
            "k_proj": ("qkv_proj", 1, [q, kv, kv]),
            "v_proj": ("qkv_proj", 2, [q, kv, kv]),
            "gate_proj": ("gate_up_proj", 0, [inter, inter]),
            "up_proj": ("gate_up_proj", 1, [inter, inter]),
        }

    def shard_of(self, name: str, block: int | None) -> tuple | str | None:
        """Which part of a checkpoint tensor this rank's parameter `name` (block `block` of a fused
        one) holds: (dim, start, length[, "pad"]), None for all of it, or "zero" (a row-parallel bias,
        added once: rank 0 holds it, the others hold zeros). "pad": the part may be shorter than the
        parameter (vocabulary rows)."""
        tp, c = self.tp, self.config
        if not tp.enabled:
            return None
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ["qkv_proj", "weight"]
        if leaf[0] == "qkv_proj":
            if block == 0:
                start, n = tp.split(c.num_attention_heads, "num_attention_heads")
            else:
                start, n = tp.kv_heads(c.num_attention_heads, c.num_key_value_heads)
            return 0, start * c.head_dim, n * c.head_dim
        if leaf == ["o_proj", "weight"]:
            start, n = tp.split(c.num_attention_heads, "num_attention_heads")
            return 1, start * c.head_dim, n * c.head_dim
        if leaf[0] == "gate_up_proj":
            return (0, *tp.split(c.intermediate_size, "intermediate_size"))
        if leaf == ["down_proj", "weight"]:
            return (1, *tp.split(c.intermediate_size, "intermediate_size"))
        if leaf in (["down_proj", "bias"], ["o_proj", "bias"]):
            return None if tp.rank == 0 else "zero"
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, end, _ = tp.vocab_range(c.vocab_size)
            return 0, start, end - start, "pad"  # the last rank's rows end in zero padding
        return None


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise AssetError(f"{model_dir}: not a model directory (no config.json)")
    cfg = json.loads(path.read_text())
    fp8_block_size(cfg, str(path))  # a quantised checkpoint we cannot read is refused before anything is built
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():  # generation_config's eos list (e.g. Llama-3's <|eot_id|>) wins over config's
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return cfg


def load_llama(model_dir: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu",
               tp: TensorParallel = SINGLE, layers: Sequence[int] | None = None) -> LlamaForCausalLM:
    """Build from config.json and load safetensors weights; dtype is bf16/fp16/fp32 or a torch dtype.
    With `tp`, the rank reads only its shard of each tensor from the files (never the whole model).
    With `layers`, a partial model: the embedding, final norm and lm_head whole, and only those
    decoder layers (the others are AbsentLayer): what a head trains against and copies its first
    weights from, when the target's forward runs elsewhere (tensor-parallel shards, precomputed
    hidden states). Its config and fingerprint are the whole model's."""
    model_dir = Path(model_dir)
    cfg = LlamaConfig.from_hf(read_hf_config(model_dir), where=str(model_dir / "config.json"))
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, tp)
    except ValueError as e:  # a shape the tensor-parallel size cannot split
        raise AssetError(f"{model_dir / 'config.json'}: {e}") from None
    model = materialise(model, device, torch_dtype, layers)
    load_weights(model, model_dir, model.packed_names(), skip=("rotary_emb.inv_freq",), shard=model.shard_of)
    model.source_dir = model_dir
    return model.eval().requires_grad_(False)
