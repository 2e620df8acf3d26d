"""The DeepSeek family: DeepSeek-V2 / V2-Lite and DeepSeek-V3 / R1 (HF model_type deepseek_v2,
deepseek_v3): config, mixture-of-experts MLPs, decoder layers, model and loader. Its attention, Multi-head
Latent Attention over a latent KV cache, is in headstart.models.deepseek_mla.

MoE. Layers from first_k_dense_replace on (every moe_layer_freq-th) replace the MLP with shared
experts (always on) plus n_routed_experts routed ones, num_experts_per_tok per token: scores are
softmax (V2) or sigmoid (V3) of an fp32 router; the choice is greedy, group-limited (V2: the
topk_group groups with the best expert) or V3's noaux_tc (groups ranked by the sum of their two
best bias-corrected scores; the bias only chooses, the weights are the uncorrected scores); weights
are optionally renormalised (norm_topk_prob) and multiplied by routed_scaling_factor. The routed experts'
weights are stacked (headstart.nn.experts): one grouped matmul per projection, no host sync, in training
and on a GPU; one row-invariant Linear per expert in the CPU engine. With the engine's CPU kernels
(`enable_cpu_kernels`) the fp32 router runs as an fp32 Linear, so a token's bits do not depend
on what shares its step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headstart.errors import AssetError
from headstart.models.base import CausalLM, materialise
from headstart.models.deepseek_mla import MLAttention
from headstart.models.loading import check_sizes, load_weights
from headstart.nn.attention import AttentionBackend, AttentionMetadata, KVPages
from headstart.nn.experts import RoutedExperts
from headstart.nn.linear import Linear, init_like_linear, weight_version
from headstart.nn.mlp import _ACTIVATIONS, GatedMLP
from headstart.nn.norm import RMSNorm
from headstart.nn.parallel import SINGLE, TensorParallel, VocabParallelEmbedding, VocabParallelLinear
from headstart.nn.rope import RopeConfig, RotaryEmbedding, yarn_mscale

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _yarn_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """HF's YaRN defaults for what a config leaves out: original_max_position_embeddings is the model's
    max_position_embeddings, factor their ratio."""
    out = dict(cfg)
    for section in ("rope_scaling", "rope_parameters"):
        sc = out.get(section)
        if isinstance(sc, dict) and sc.get("rope_type", sc.get("type")) == "yarn":
            sc = dict(sc)
            sc.setdefault("original_max_position_embeddings", out.get("max_position_embeddings", 4096))
            if sc.get("factor") is None:
                sc["factor"] = out.get("max_position_embeddings", 4096) / sc["original_max_position_embeddings"]
            out[section] = sc
    return out


@dataclass(kw_only=True)
class DeepseekConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    normalise_one: bool = False  # norm_topk_prob with one expert per token too (HF's V3; V2's code skips it)
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0  # MTP layers the checkpoint ships after the decoder layers
    rope: RopeConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None  # none: the engine reads it for every family

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the paged cache: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, j: int) -> bool:
        return bool(self.n_routed_experts) and j >= self.first_k_dense_replace and j % self.moe_layer_freq == 0

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is YaRN."""
        scale = self.qk_head_dim ** -0.5
        sc = self.rope.scaling if self.rope is not None else {}
        if sc.get("rope_type", sc.get("type")) == "yarn" and sc.get("mscale_all_dim"):
            scale *= yarn_mscale(float(sc["factor"]), sc["mscale_all_dim"]) ** 2
        return scale

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json") -> DeepseekConfig:
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise AssetError(f"{where}: model_type {mt!r} is not supported by headstart.models.deepseek "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        check_sizes(cfg, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
                    ("max_position_embeddings",), where)
        v3 = mt == "deepseek_v3"
        experts = cfg.get("n_routed_experts")
        # A routed-expert config must say how it routes: HF's and DeepSeek's own code default these
        # differently, so an absent one is refused rather than guessed.
        needed = ["num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor"]
        if v3 or cfg.get("topk_method") == "group_limited_greedy":
            needed += ["n_group", "topk_group"]
        for key in needed if experts else []:
            if cfg.get(key) is None:
                raise AssetError(f"{where}: n_routed_experts is {experts} but {key} is not set; state it (the "
                                 "checkpoint's config.json does)")
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = cfg.get(key)
            if key in cfg and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise AssetError(f"{where}: {key} = {value!r} is not supported: it must be a positive integer")
        q_rank = cfg.get("q_lora_rank")
        if q_rank is not None and not (isinstance(q_rank, int) and not isinstance(q_rank, bool) and q_rank > 0):
            raise AssetError(f"{where}: q_lora_rank = {q_rank!r} is not supported: a positive integer, or null for "
                             "a plain q_proj")
        for key, why in (("mlp_bias", "the MLPs and experts here have no biases"),
                         ("use_sliding_window", "MLA runs full attention")):
            if cfg.get(key):
                raise AssetError(f"{where}: {key} = {cfg[key]!r} is not supported: {why}")
        if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise AssetError(f"{where}: partial_rotary_factor = {cfg['partial_rotary_factor']!r} is not supported: "
                             "the rope part (qk_rope_head_dim) is rotated whole")
        cfg = _yarn_defaults(cfg)
        try:
            eos = cfg.get("eos_token_id")
            out = cls(
                model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=cfg["num_attention_heads"], q_lora_rank=cfg.get("q_lora_rank"),
                kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                hidden_act=cfg.get("hidden_act", "silu"),
                attention_bias=bool(cfg.get("attention_bias", False)), n_routed_experts=experts,
                n_shared_experts=cfg.get("n_shared_experts"),
                moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
                num_experts_per_tok=cfg.get("num_experts_per_tok") or 1,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                # HF's DeepSeek-V3 always scores with a sigmoid and chooses with noaux_tc.
                scoring_func=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
                topk_method=cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
                n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)), normalise_one=v3,
                first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
                moe_layer_freq=cfg.get("moe_layer_freq") or 1,
                num_nextn_predict_layers=cfg.get("num_nextn_predict_layers") or 0,
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                bos_token_id=cfg.get("bos_token_id"),
            )
            rope = RopeConfig.from_hf(cfg, cfg["qk_rope_head_dim"])
        except KeyError as e:
            raise AssetError(f"{where}: missing key {e.args[0]!r}") from None
        except ValueError as e:
            raise AssetError(f"{where}: {e}") from None
        # V2 always rotates interleaved pairs; V3 unless rope_interleave is false.
        rope.interleaved = not v3 or bool(cfg.get("rope_interleave", True))
        out.rope = rope
        out.check(where)
        return out

    def check(self, where: str) -> None:
        """Refuse, by name, what this implementation does not compute."""
        def bad(key: str, value: Any, why: str) -> AssetError:
            return AssetError(f"{where}: {key} = {value!r} is not supported: {why}")

        if self.hidden_act not in _ACTIVATIONS:
            raise bad("hidden_act", self.hidden_act, f"supported: {', '.join(sorted(_ACTIVATIONS))}")
        if self.scoring_func not in SCORING:
            raise bad("scoring_func", self.scoring_func, f"supported: {', '.join(SCORING)}")
        if self.topk_method not in TOPK_METHODS:
            raise bad("topk_method", self.topk_method, f"supported: {', '.join(TOPK_METHODS)}")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise bad("n_group", self.n_group, f"it must divide n_routed_experts ({self.n_routed_experts})")
            if not 1 <= self.topk_group <= self.n_group:
                raise bad("topk_group", self.topk_group, f"it must be within 1..n_group ({self.n_group})")
            if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
                raise bad("n_group", self.n_group, "noaux_tc ranks groups by their two best experts")
            reach = self.n_routed_experts // self.n_group * (self.topk_group if self.topk_method != "greedy" else
                                                            self.n_group)
            if not 1 <= self.num_experts_per_tok <= reach:
                raise bad("num_experts_per_tok", self.num_experts_per_tok,
                          f"the chosen groups hold {reach} experts")
            if not self.moe_intermediate_size:
                raise bad("moe_intermediate_size", self.moe_intermediate_size, "routed experts need a width")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", self.qk_rope_head_dim, "RoPE rotates pairs")

    def parameter_count(self) -> int:
        """Parameters of the model as built here (the MTP layers a checkpoint ships are not)."""
        d = self.hidden_size
        layers = sum(self.layer_parameter_count(j) for j in range(self.num_hidden_layers))
        return layers + self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d

    def layer_parameter_count(self, j: int) -> int:
        """Parameters of decoder layer j (MLA, its MLP or MoE, two norms)."""
        d, h = self.hidden_size, self.num_attention_heads
        q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
             if self.q_lora_rank else d * h * self.qk_head_dim)
        attn = q + d * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * h * (
            self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * d
        dense = 3 * d * self.intermediate_size
        moe = (3 * d * self.moe_intermediate_size * ((self.n_routed_experts or 0) + (self.n_shared_experts or 0))
               + (self.n_routed_experts or 0) * (d + (self.topk_method == "noaux_tc")))  # router, its bias
        return attn + 2 * d + (moe if self.is_moe_layer(j) else dense)


    def active_parameter_count(self) -> int:
        """Parameters one token's forward multiplies by: the routed experts it is sent to, not all."""
        idle = (self.n_routed_experts or 0) - self.num_experts_per_tok
        moe_layers = sum(self.is_moe_layer(j) for j in range(self.num_hidden_layers))
        return self.parameter_count() - moe_layers * max(idle, 0) * 3 * self.hidden_size * self.moe_intermediate_size


class Router(nn.Module):
    """Top-k expert choice of one MoE layer (module docstring); scores in fp32."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        init_like_linear(self.weight)
        if cfg.topk_method == "noaux_tc":
            # It only chooses experts (no gradient reaches it): never trained, loaded like a weight.
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)

    def own_cpu_kernels(self, rowwise: bool, max_rows: int | None) -> list[str]:
        """An fp32 copy of the router weight with the CPU kernels (used by no-grad forwards while the weight
        is unchanged), so the scores' bits do not depend on the step's rows."""
        lin = Linear(self.weight.shape[1], self.weight.shape[0], bias=False).to(self.weight.device)
        lin.weight.data.copy_(self.weight.float())
        lin.requires_grad_(False)
        got = lin.enable_cpu_kernels(rowwise, max_rows)
        object.__setattr__(self, "_fp32", (weight_version(self.weight), lin))
        return [got]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, D) -> weights (N, k) fp32, expert ids (N, k)."""
        cfg = self.cfg
        own = self.__dict__.get("_fp32")
        if own is not None and not torch.is_grad_enabled() and own[0] == weight_version(self.weight):
            logits = own[1](x.float())
        else:
            logits = torch.nn.functional.linear(x.float(), self.weight.float())
        # In float64, rounded to fp32: torch's vectorised fp32 sigmoid / softmax give other bits in a vector's
        # tail (the step's row count moves the tail), which would make the choice depend on the batch.
        wide = logits.double()
        scores = (wide.softmax(-1) if cfg.scoring_func == "softmax" else wide.sigmoid()).float()
        choice = scores + self.e_score_correction_bias.float() if cfg.topk_method == "noaux_tc" else scores
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            grouped = choice.view(x.shape[0], cfg.n_group, -1)
            rank = grouped.max(-1).values if cfg.topk_method == "group_limited_greedy" else \
                grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, rank.topk(cfg.topk_group, dim=-1).indices, True)
            # Masked experts can never be chosen: 0 under softmax (V2), -inf for the biased choice (V3).
            fill = 0.0 if cfg.topk_method == "group_limited_greedy" else float("-inf")
            choice = choice.masked_fill(~keep.repeat_interleave(cfg.n_routed_experts // cfg.n_group, dim=1), fill)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob and (cfg.num_experts_per_tok > 1 or cfg.normalise_one):
            # Summed column by column: a vectorised sum's order may depend on the number of rows.
            total = weights[:, 0]
            for j in range(1, weights.shape[1]):
                total = total + weights[:, j]
            weights = weights / (total.unsqueeze(-1) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


def keep_routers_fp32(module: nn.Module) -> None:
    """The routers' weight and bias stay fp32 in a bf16 model, as HF keeps them (the expert choice is a
    ranking: bf16 weights would send some tokens to other experts)."""
    for m in module.modules():
        if isinstance(m, Router):
            m.float()


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                     _ACTIVATIONS[cfg.hidden_act])
        shared = cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
        self.shared_experts = GatedMLP(cfg.hidden_size, shared, cfg.hidden_act) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out + self.shared_experts(x) if self.shared_experts is not None else out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, j: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(
            hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, rms_norm_eps=cfg.rms_norm_eps, attention_bias=cfg.attention_bias,
            softmax_scale=cfg.softmax_scale, rope=rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(j) else GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                                                 cfg.hidden_act)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVPages,
                backend: AttentionBackend) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), meta, cache, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekBackbone(nn.Module):
    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, j, self.rotary) for j in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(CausalLM):
    """A DeepSeek target: parameter names follow HF's (gate/up fused per MLP and expert)."""

    cache_heads = 1
    cache_shared = True  # the latent row is both the keys and the values

    def __init__(self, cfg: DeepseekConfig, tp: TensorParallel = SINGLE) -> None:
        if tp.enabled:
            raise ValueError("tensor parallelism is not implemented for DeepSeek targets (MLA + MoE); use "
                             "engine.tensor_parallel 1")
        super().__init__(cfg, tp)
        self.model = DeepseekBackbone(cfg)
        self.lm_head = VocabParallelLinear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def cache_head_dim(self) -> int:
        return self.config.latent_dim

    @property
    def num_local_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_local_kv_heads(self) -> int:
        return 1

    @staticmethod
    def packed_names() -> dict[str, tuple[str, int, list[int]]]:
        """HF fragment -> (our fused parameter, block, block sizes): gate/up of every MLP and expert (the loader
        stacks the experts' `experts.{e}.` tensors into `experts.gate_up_proj` / `down_proj`)."""
        return {"gate_proj": ("gate_up_proj", 0, [-1, -1]), "up_proj": ("gate_up_proj", 1, [-1, -1])}


def check_memory(cfg: DeepseekConfig, dtype: torch.dtype, device: torch.device | str, where: str,
                 layers: Sequence[int] | None = None) -> None:
    """Refuse a model whose weights (of the kept `layers`, all by default) exceed what the device has,
    before anything is allocated."""
    params = cfg.parameter_count()
    if layers is not None:
        keep = {j % cfg.num_hidden_layers for j in layers}
        per_layer = [cfg.layer_parameter_count(j) for j in range(cfg.num_hidden_layers)]
        params -= sum(n for j, n in enumerate(per_layer) if j not in keep)
    need = params * dtype.itemsize
    device = torch.device(device)
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    elif device.type == "cpu":
        have = _available_host_memory()
    else:
        return
    if need > have:
        raise AssetError(f"{where}: the weights need {need / 1e9:.1f} GB ({params / 1e9:.2f} B parameters x "
                         f"{dtype.itemsize} B) and {device} has {have / 1e9:.1f} GB available")


def _available_host_memory() -> int:
    """MemAvailable (free + reclaimable page cache: a machine that just read the weights has little free)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def load_deepseek(model_dir: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu",
                  tp: TensorParallel = SINGLE, layers: Sequence[int] | None = None) -> DeepseekForCausalLM:
    """Build from config.json and load the safetensors weights (see load_llama for `layers`). The MTP
    layers a checkpoint ships after the decoder layers are not part of the target."""
    from headstart.models.llama import DTYPES, read_hf_config

    model_dir = Path(model_dir)
    where = str(model_dir / "config.json")
    cfg = DeepseekConfig.from_hf(read_hf_config(model_dir), where=where)
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if tp.enabled:
        raise AssetError(f"{where}: tensor parallelism is not implemented for DeepSeek targets (MLA + MoE); use "
                         "engine.tensor_parallel 1")
    check_memory(cfg, torch_dtype, device, where, layers)
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg)
    model = materialise(model, device, torch_dtype, layers)
    keep_routers_fp32(model)
    load_weights(model, model_dir, model.packed_names(), skip=("rotary_emb.inv_freq",))
    model.source_dir = model_dir
    return model.eval().requires_grad_(False)


__all__ = ["DeepseekConfig", "DeepseekForCausalLM", "load_deepseek"]
