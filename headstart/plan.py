"""`headstart plan RECIPE`: what each rank of a recipe's jobs needs, before any of them runs.

For each phase the recipe runs (precompute when training from shards, training, engine validation, eval) it adds up
per-rank device memory by term (the target's share of weights, the head with its gradients and AdamW state,
activations incl. TTT attention masks and the chunked loss, KV pages) and compares the sum with the device; it also
gives the host memory a rank needs while loading, the disk bytes per stored token, and throughput from stated
assumptions. A phase that cannot fit is refused, naming its largest term; `train` and `precompute` run the same
check before they load.

The numbers come from the target's config.json and the recipe alone (no weights are read): weights
and optimizer state are exact counts (the head is built on the meta device); activations are upper
bounds from the shapes the code allocates (each formula is named in its term's note).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from headstart.config import Recipe
from headstart.errors import HeadstartError
from headstart.sizing import FLASHINFER_WORKSPACE_MB, QUANT_ROWS, chunk_row_bytes, grad_components, loss_chunk_rows

GB = 1e9
# Headroom kept free on a device: the CUDA context, the caching allocator's fragmentation, NCCL buffers.
USABLE = 0.90
# Throughput assumptions (stated in every plan): H100 SXM dense bf16 peak (NVIDIA H100 datasheet:
# 989 TFLOP/s without sparsity) and the share of it a step reaches.
H100_BF16_FLOPS = 989e12
MFU_TARGET_FORWARD = 0.40  # a large-batch bf16 forward of an 8B+ model (typical of inference prefill)
MFU_HEAD_STEP = 0.25  # one-layer head: small matmuls, a vocabulary-sized loss, optimizer steps


class PlanError(HeadstartError):
    """A recipe that cannot fit; the message names the phase and the term."""


@dataclass
class Term:
    name: str
    bytes: float
    note: str = ""


@dataclass
class Phase:
    name: str  # precompute / train / validation / eval
    ranks: int  # processes the phase runs on
    terms: list[Term] = field(default_factory=list)
    host_bytes: float = 0.0  # host memory per rank while loading
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)


@dataclass
class Plan:
    recipe: str
    device: str
    capacity: float  # bytes per device
    phases: list[Phase]
    disk_bytes_per_token: float | None
    assumptions: list[str]
    # Where the recipe's head will serve (headstart.export.serving: each engine's layouts' own refusals).
    serving: list[str] = field(default_factory=list)

    def refusals(self) -> list[str]:
        out = []
        for ph in self.phases:
            if ph.total > USABLE * self.capacity:
                big = max(ph.terms, key=lambda t: t.bytes)
                out.append(f"{ph.name}: needs {ph.total / GB:.1f} GB per rank, more than {USABLE:.0%} of the "
                           f"{self.capacity / GB:.0f} GB {self.device}; the largest term is '{big.name}' "
                           f"({big.bytes / GB:.1f} GB{': ' + big.note if big.note else ''})")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for ph, raw in zip(self.phases, d["phases"]):
            raw["total"] = ph.total
        d["refusals"] = self.refusals()
        return d


# The train terms for what one micro-batch keeps for backward (tests/test_training_memory.py and
# benchmarks/gpu_check.py compare autograd's saved bytes with their sum).
ACTIVATION_TERMS = ("head activations", "chunked loss", "TTT attention (padded rows)", "attention (padded rows)",
                    "TTT attention masks", "block attention mask", "fused loss gradients")


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def target_shape(cfg: dict[str, Any], where: str) -> Any:
    from headstart.models.deepseek import SUPPORTED_MODEL_TYPES, DeepseekConfig
    from headstart.models.llama import LlamaConfig

    if cfg.get("model_type") in SUPPORTED_MODEL_TYPES:
        return DeepseekConfig.from_hf(cfg, where=where)
    return LlamaConfig.from_hf(cfg, where=where)


def _is_deepseek(c: Any) -> bool:
    return hasattr(c, "kv_lora_rank")


def target_params(c: Any, tp: int) -> tuple[float, float]:
    """(parameters one tensor-parallel rank holds, parameters of the whole target)."""
    kv_local = max(1, c.num_key_value_heads // tp)
    layer_whole = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                   + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
                   + 2 * c.hidden_size)
    layer_rank = (c.hidden_size * (c.num_attention_heads // tp + 2 * kv_local) * c.head_dim
                  + c.num_attention_heads // tp * c.head_dim * c.hidden_size
                  + 3 * c.hidden_size * c.intermediate_size // tp + 2 * c.hidden_size)
    vocab = (1 if c.tie_word_embeddings else 2) * c.vocab_size * c.hidden_size
    whole = c.num_hidden_layers * layer_whole + vocab + c.hidden_size
    rank = c.num_hidden_layers * layer_rank + vocab / tp + c.hidden_size
    return rank, whole


def _head_counts(recipe: Recipe, c: Any) -> tuple[int, Any, list[str], int]:
    """(trainable parameters, resolved config, where it serves, its KV values per token): built on the meta device."""
    import torch

    from headstart.export.serving import summary
    from headstart.heads import build_head, head_config_from_recipe
    from headstart.inference.proposers import draft_kv_spec
    from headstart.models.deepseek import DeepseekForCausalLM
    from headstart.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        target = DeepseekForCausalLM(c) if _is_deepseek(c) else LlamaForCausalLM(c)
        target._fingerprint = "planning"  # no weights to hash: the head only records it
        head = build_head(head_config_from_recipe(recipe.head), target, init_from_target=False)
    kv = 0 if (spec := draft_kv_spec(head)) is None else spec.bytes_per_page(1) // spec.dtype.itemsize  # Medusa: 0
    return sum(p.numel() for p in head.trainable_parameters()), head.config, summary(head), kv


def make_plan(recipe: Recipe, target_cfg: dict[str, Any], *, device: str = "H100-80GB",
              capacity_gb: float = 80.0, where: str = "config.json", phases: tuple[str, ...] | None = None) -> Plan:
    """The plan of the recipe's phases (default: precompute when training from shards, train,
    validation, eval), or of `phases`."""
    from headstart.models.loading import fp8_block_size

    try:  # a quantization every loading verb refuses (AWQ, GPTQ, ...) cannot be planned as if it loaded
        fp8_block_size(target_cfg, where)
    except HeadstartError as e:
        raise PlanError(str(e)) from None
    c = target_shape(target_cfg, where)
    tp = recipe.engine.tensor_parallel
    for n, what in ((c.num_attention_heads, "num_attention_heads"), (c.intermediate_size, "intermediate_size")):
        if n % tp:
            raise PlanError(f"engine.tensor_parallel {tp}: {what} ({n}) of {where} is not divisible by it")
    tr, pc = recipe.train, recipe.precompute
    act = _dtype_bytes(recipe.target.dtype if recipe.target.dtype != "auto" else "bf16")
    ranks = recipe.trainer.devices * recipe.trainer.num_nodes
    d, n_layers = c.hidden_size, c.num_hidden_layers
    if _is_deepseek(c):  # MLA + MoE: unsharded; the cache holds one latent row per token and layer
        if tp > 1:
            raise PlanError(f"engine.tensor_parallel {tp}: DeepSeek targets run unsharded (tensor parallelism for "
                            "MLA + MoE is not implemented)")
        rank_params = whole_params = c.parameter_count()
        active_params = c.active_parameter_count()
        kv_bytes_per_token = n_layers * c.latent_dim * act
    else:
        rank_params, whole_params = target_params(c, tp)
        active_params = whole_params
        kv_bytes_per_token = 2 * n_layers * max(1, c.num_key_value_heads // tp) * c.head_dim * act
    if ranks % tp and (phases is None or "train" in phases or "validation" in phases):
        # Training splits its ranks into groups of tp that each hold one copy of the target: a rank
        # planned with 1/tp of the weights but no group to share the rest with would not run at all.
        raise PlanError(f"engine.tensor_parallel {tp} does not divide the training ranks, trainer.devices x "
                        f"trainer.num_nodes = {recipe.trainer.devices} x {recipe.trainer.num_nodes} = {ranks}: "
                        f"set trainer.devices to a multiple of {tp} (or lower engine.tensor_parallel)")
    head_params, hc, serving, draft_kv = _head_counts(recipe, c)
    aux = len(hc.aux_layer_ids or [])
    # eagle3's input norms (norm_before_fc, fc_norm) keep a normed copy of the A aux states for backward.
    aux_saved = aux if hc.norm_before_fc or hc.fc_norm else 0
    vd = hc.draft_vocab_size or c.vocab_size
    largest_tensor = max(c.vocab_size * d / tp, 3 * d * c.intermediate_size / tp) * act
    plan_phases: list[Phase] = []

    def target_term(shard: int) -> Term:
        held = rank_params if shard > 1 else whole_params
        how = f"1/{shard} tensor-parallel shard" if shard > 1 else "the whole target on every rank"
        return Term("target weights", held * act, f"{held / 1e9:.2f} B parameters ({how})")

    def forward_terms(tokens: int, storage: str = "") -> list[Term]:
        # The widest transient of a no-grad layer beside its input, the residual and the normed copy: the fused
        # gate/up output (2I/tp) with the activated product (I/tp, taken in place), or the attention: q, K, V and
        # the output padded per length bucket (under 2x the rows) beside their unpadded forms, K/V expanded to the
        # query heads (on CUDA) and MLA expanded; or, after the last layer, the aux states stacked (and
        # concatenated) beside their list. Captured states are kept throughout (measured on CPU:
        # tests/test_precompute_memory.py).
        hd = (c.qk_nope_head_dim + c.qk_rope_head_dim) if _is_deepseek(c) else c.head_dim
        heads = c.num_attention_heads // tp
        if _is_deepseek(c):  # MLA expanded for prefill: q, kv_b's keys and values, query and keys rebuilt, v padded
            width, rest = max(hd, c.v_head_dim), 2 * hd + c.qk_nope_head_dim + c.v_head_dim
            attn = (heads * (12 * width + rest) + 2 * d,
                    f"{heads} heads x (12 x {width} + {rest}) (MLA expanded, padded per length bucket) + 2 d")
        else:
            attn = (heads * 12 * hd + 2 * d, f"12 x {heads} heads x {hd} (attention, padded per length bucket) + 2 d")
        options = [(3 * c.intermediate_size / tp + 3 * d, "3 I/tp + 3 d"), attn,
                   ((1 + aux) * d, f"(1 + {aux}) d: the aux states stacked")]
        if _is_deepseek(c) and c.n_routed_experts:  # each token's k rows gathered, their gate/up, product and outputs
            k, mi = c.num_experts_per_tok, c.moe_intermediate_size
            # then y beside its product with the fp32 router weights, y promoted to fp32 inside (bf16: 1 + 2 + 2 d)
            wide = max(4 * mi, (1 + 8 // act) * d)
            options.append((k * wide + 3 * d, f"{k} routed x max(4 x {mi}, {1 + 8 // act} d) + 3 d"))
        per, how = max(options, key=lambda o: o[0])
        wide, note = tokens * per * act, f"{tokens:,} tokens x ({how}) x {act} B"
        rows = min(tokens, QUANT_ROWS)
        quant = rows * max(1, aux) * d * (3 * 4 + 1)  # fp32 copy, |x| and x / scale, the e4m3 rows
        if storage == "fp8" and quant > wide:
            wide, note = quant, f"the fp8 quantisation after the forward: {rows:,} rows x {max(1, aux)} x d x 13 B"
        return [Term("target activations", wide, note),
                Term("captured hidden states", tokens * d * (1 + aux) * act,
                     f"{tokens:,} tokens x d x (1 + {aux} aux layers)"),
                Term("token metadata", tokens * (4 * 8 + 2 * hd * 4),
                     f"{tokens:,} tokens x (ids, positions, slots, lengths: int64; rope cos and sin: fp32)")]

    wanted = phases or (("precompute",) if tr.source == "shards" else ()) + ("train", "validation", "eval")
    if "precompute" in wanted:
        ph = Phase("precompute", ranks)
        # a sequence longer than batch_tokens is a batch of its own, and the KV pool holds it
        one = max(pc.batch_tokens, recipe.data.max_length)
        ph.terms = [target_term(tp), *forward_terms(one, pc.storage),
                    Term("KV pages", (one + 64 * 16) * kv_bytes_per_token, f"one batch of {one:,} tokens + 64 pages")]
        if device != "CPU RAM" and recipe.engine.backend in ("auto", "flashinfer") and pc.backend == "engine":
            ph.terms.append(Term("FlashInfer workspace", FLASHINFER_WORKSPACE_MB << 20, "the backend's buffer"))
        ph.host_bytes = largest_tensor
        plan_phases.append(ph)
    # Training: the target whole on every rank, or its tensor-parallel shard beside whole copies of
    # what the head reads (embedding, final norm, lm_head, the layers its init copies).
    from headstart.heads import init_copied_layers

    fsdp = recipe.trainer.strategy == "fsdp"
    ph = Phase("train", ranks)
    layer_params = 0 if _is_deepseek(c) else target_params(dataclasses.replace(c, num_hidden_layers=1, vocab_size=0),
                                                             1)[1] - d  # used under tensor parallelism only
    if fsdp:
        # FSDP2 (train.module.HeadStep): each rank keeps 1/ranks of the state; a micro-batch gathers the whole
        # head once and keeps it until its backward ends (bf16 weights under bf16-mixed on GPUs), with its
        # whole fp32 gradient until the one reduce-scatter.
        # bf16 weights gathered, their bf16 gradient and its fp32 copy for the reduce; fp32: 4 + 4.
        low = recipe.trainer.precision in ("bf16-mixed", "bf16-true", "auto")
        gathered = 2 + 2 + 4 if low else 4 + 4
        opt = Term("head weights + grads + AdamW", 16 * head_params / ranks + gathered * head_params,
                   f"{head_params / 1e6:.1f} M trainable parameters x 16 B / {ranks} ranks (FSDP), + the whole "
                   f"head gathered with its gradient ({gathered} B each)")
    else:
        opt = Term("head weights + grads + AdamW", 16 * head_params,
                   f"{head_params / 1e6:.1f} M trainable parameters x 16 B (fp32 weight, grad, 2 moments)")
    seq = min(recipe.data.max_length, tr.batch_tokens)
    on_gpu = device != "CPU RAM" and recipe.trainer.accelerator != "cpu"
    # the head's compute dtype: bf16 under bf16 precision (auto: on GPUs); 4 B otherwise (16-mixed over-counted)
    gb = 2 if recipe.trainer.precision in ("bf16-mixed", "bf16-true") or (recipe.trainer.precision == "auto"
                                                                           and on_gpu) else 4
    per_tok = (d * (22 + 2 * aux + aux_saved) + 6 * hc.intermediate_size) * gb  # one layer's saved activations
    from headstart.heads.config import CHAIN_HEADS

    # A chunk's recompute keeps every TTT step's log q beside the one teacher they share (train.losses).
    loss_steps = tr.ttt_steps if hc.head_type in CHAIN_HEADS else 1
    lk = tr.loss != "kl"
    # a chunk holds at most the micro-batch's rows, whatever train.loss_chunk_tokens asks
    chunk = min(loss_chunk_rows(tr.loss_chunk_tokens, vd, loss_steps, "cuda" if on_gpu else "cpu", tr.batch_tokens,
                                lk, c.vocab_size), tr.batch_tokens)
    ph.terms = [target_term(tp), opt,
                Term("head activations", tr.batch_tokens * per_tok * tr.ttt_steps,
                     f"{tr.batch_tokens:,} tokens x {tr.ttt_steps} TTT steps x "
                     f"(({22 + 2 * aux + aux_saved} d + 6 I) x {gb} B)"),
                Term("chunked loss", chunk * chunk_row_bytes(vd, loss_steps, lk, c.vocab_size),
                     f"{chunk:,} rows x {vd:,} logits x fp32 x ({loss_steps} steps' log q + the "
                     "teacher's log p and p, shared by the steps + a gradient)" + (
                         f"; {tr.loss}: + each step's q and the teacher's p on them"
                         + (f", + the teacher's {c.vocab_size:,}-token logits and softmax" if vd != c.vocab_size
                            else "") if lk else ""))]
    if not on_gpu and hc.head_type == "eagle3" and hc.draft_vocab_size:
        # train.losses.FusedChunks: the gradients of the draft lm_head and of its input rows, per step and loss term,
        # taken in the forward pass and kept for backward (instead of a recompute)
        comps = len(grad_components(tr.loss))  # the objective's terms only
        ph.terms.append(Term("fused loss gradients", loss_steps * comps * (vd + tr.batch_tokens) * d * 4,
                             f"{loss_steps} steps x {comps} loss term(s) x ({vd:,} lm_head rows + {tr.batch_tokens:,} "
                             "rows) x d x fp32"))
    if hc.head_type == "dflash":  # anchored blocks instead of token rows; every layer's context K/V and scores
        bs = hc.block_size or 8
        q = min(recipe.head.max_anchors, tr.batch_tokens) * bs
        kv = 2 * hc.num_key_value_heads * hc.head_dim
        # heads.dflash: per layer and bucket (sequences bucketed by length, then by block rows: under 2x padding
        # of each) one fused SDPA call over the context and block keys; the padded K/V copies are kept, no scores,
        # and the (block queries x (context + block keys)) masks shared by the layers (bool, and one copy in the
        # compute dtype): at most 2 q padded queries, each seeing at most seq + q keys.
        ph.terms[2] = Term("head activations", q * per_tok * hc.num_layers
                           + tr.batch_tokens * d * gb + 2 * (tr.batch_tokens + q) * kv * hc.num_layers * gb,
                           f"{q:,} block rows x {hc.num_layers} layers x (({22 + 2 * aux} d + 6 I) x {gb} B), + "
                           f"{tr.batch_tokens:,} context rows x d, + 2 x ({tr.batch_tokens:,} context + {q:,} block) "
                           f"padded rows x {hc.num_layers} x 2 KV")
        ph.terms.append(Term("block attention mask", (1 + gb) * 2 * q * (seq + q),
                             f"2 x {q:,} padded block queries x ({seq:,} context + {q:,} block keys) x (1 + {gb}) B, "
                             "shared by the layers (fused kernels keep no scores)"))
    if hc.head_type in (*CHAIN_HEADS, "draft_lm"):
        ph.terms.append(_padded_attention_term(recipe, c, hc, gb, on_gpu))
    if tr.ttt_steps > 1 and hc.head_type in CHAIN_HEADS and on_gpu:  # the CPU's merged steps take no mask
        # headstart.train.ttt runs each unrolled step as one fused SDPA call per length bucket: no scores
        # are kept, but step j keeps its additive (L_b, L_b (j + 1)) mask per bucket length for the backward
        # pass (shared by the layers and sequences). Bucket lengths at least halve from one to the next, so
        # their squares sum to under 4/3 of the longest's.
        cells = sum(seq * seq * (j + 1) for j in range(1, tr.ttt_steps)) * 4 / 3
        ph.terms.append(Term("TTT attention masks", cells * gb,
                             f"4/3 x {seq:,} x {seq:,} positions x (2 + ... + {tr.ttt_steps}) key copies x {gb} B "
                             "(steps 1..; per bucket length; fused kernels keep no scores)"))
    if hc.draft_vocab_size and hc.head_type in ("mtp", "eagle1", "deepseek_mtp", "dflash"):
        ph.terms.append(Term("restricted lm_head", vd * d * act, f"{vd:,} target rows gathered once"))
    parts_term = None
    if tp > 1:
        copied = len(init_copied_layers(recipe.head))
        parts = (1 if c.tie_word_embeddings else 2) * c.vocab_size * d + d + copied * layer_params
        parts_term = Term("embedding + lm_head (whole)", parts * act,
                          f"what the head reads (and the final norm), unsharded, + {copied} target layer(s) its "
                          "init copies")
        ph.terms.append(parts_term)
    if tr.source == "online":
        ph.terms.extend(forward_terms(tr.batch_tokens))
    # Under TP the whole embedding / lm_head are read too: one whole vocabulary tensor at a time.
    ph.host_bytes = max(largest_tensor, c.vocab_size * d * act) if tp > 1 else largest_tensor
    if tp == 1 and tr.source == "shards" and ranks > 1:
        ph.notes.append("from shards: only rank 0 (which validates) holds the whole target; the other ranks hold "
                        "its embedding, final norm and lm_head")
    if tp > 1 and tr.source == "online":
        ph.notes.append(f"online: each tensor-parallel group of {tp} runs its members' micro-batch forwards in "
                        "turn (target FLOPs as under data parallelism, 1/tp of the weights per rank)")
    plan_phases.append(ph)
    from headstart.sizing import EVAL_BATCH, engine_kv_tokens
    val = Phase("validation", ranks)  # inside training: the head's state (and the partial target) stay resident
    la = max(recipe.head.k + 1, (recipe.head.block_size or 8) if recipe.head.type == "dflash" else 0)  # SpecConfig's
    kv = kv_bytes_per_token + draft_kv * act  # the draft's cache has as many pages as the target's (engine.Engine)
    val_tokens, val_text = engine_kv_tokens(tr.val_prompts, recipe.data.max_length, tr.val_max_tokens, la)
    val.terms = [target_term(tp), Term("KV pages", val_tokens * kv, f"{val_text} (target's and draft's KV)"), opt]
    if parts_term is not None:
        val.terms.append(parts_term)
    if fsdp:
        val.terms.append(Term("gathered head", 4 * head_params, "the unsharded fp32 replica validation reads"))
    plan_phases.append(val)
    ev = Phase("eval", tp)
    ev_tokens, ev_text = engine_kv_tokens(EVAL_BATCH, recipe.data.max_length, tr.val_max_tokens, la, cap=None)
    ev.terms = [target_term(tp), Term("KV pages", ev_tokens * kv, f"eval's default batch: {ev_text} (both KVs)")]
    ev.host_bytes = largest_tensor
    plan_phases.append(ev)
    phases_made = [p for p in plan_phases if p.name in wanted]
    for p in phases_made:
        if not p.host_bytes:
            p.host_bytes = largest_tensor
    disk = None
    if tr.source == "shards":
        per_row = 2 * d if pc.storage == "bf16" else d + 4
        disk = per_row * (1 + aux) + 4 + 1 + 8 / 512  # ids int32, mask uint8, offsets
    forward_tps = MFU_TARGET_FORWARD * H100_BF16_FLOPS / (2 * active_params)
    head_active = head_params
    if _is_deepseek(c) and hc.head_type == "deepseek_mtp" and not hc.dense_block and c.n_routed_experts:
        head_active -= (c.n_routed_experts - c.num_experts_per_tok) * 3 * d * c.moe_intermediate_size
    # What a head step computes per token (train.module / losses / ttt): each TTT step runs the head forward
    # and backward (6 FLOP per active parameter) and the student logits three times (forward, the loss
    # chunk's recompute, backward: 8 d V_d); the teacher's logits run once for every step and once in the
    # recompute (4 d V_d); step j's fused attention reads L (j + 1) keys per query in each layer (4 d per key
    # forward, 8 backward), the masked ones included.
    seq_attn = sum(12 * hc.num_layers * d * seq * (j + 1) for j in range(tr.ttt_steps))
    head_flops = tr.ttt_steps * (6 * head_active + 8 * d * vd) + 4 * d * vd + seq_attn
    head_tps = MFU_HEAD_STEP * H100_BF16_FLOPS / head_flops
    assumptions = [
        f"device {device}: {capacity_gb:g} GB, {USABLE:.0%} usable (CUDA context, allocator fragmentation)",
        f"throughput: H100 dense bf16 peak {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s (NVIDIA datasheet) at an assumed "
        f"MFU of {MFU_TARGET_FORWARD:.0%} for target forwards and {MFU_HEAD_STEP:.0%} for head steps",
        f"target forward (precompute, online): ~{forward_tps * tp:,.0f} tokens/s per tensor-parallel group of "
        f"{tp} (2 x {active_params / 1e9:.2f} B FLOP/token" + (", the experts a token is routed to" if
                                                               active_params != whole_params else "") + ")",
        f"head step: ~{head_tps:,.0f} tokens/s per GPU ({head_flops / 1e9:.1f} GFLOP/token: {tr.ttt_steps} TTT steps x "
        f"(6 x head + 8 d V_d) + the teacher's 4 d V_d once + the steps' attention over {seq:,}-token sequences"
        + (f"; {head_active / 1e6:.0f} M of the head's parameters active per token" if head_active != head_params
           else "") + ")",
        "host memory while loading: each rank reads its tensors one at a time from the memory-mapped safetensors "
        "files onto its device, so a rank's host peak is its largest tensor (page cache aside); precompute then "
        "writes each batch's states into its shard file as they come (fp8 quantised on the device, 2,048 rows at a "
        "time), so no rank holds a shard in memory, whatever precompute.shard_tokens is",
    ]
    return Plan(recipe=recipe.name or "", device=device, capacity=capacity_gb * GB, phases=phases_made,
                disk_bytes_per_token=disk, assumptions=assumptions, serving=serving)


def _padded_attention_term(recipe: Recipe, c: Any, hc: Any, act: int, on_gpu: bool) -> Term:
    """What a head's training attention keeps for backward over the padded rows of its length buckets
    (nn.attention.PaddedLayout: under 2 x the micro-batch's tokens whatever the mix of lengths). TTT
    (train.ttt): per layer each step's queries and own K/V (the later steps' copies of them are rebuilt
    in the backward pass), plus the largest rebuild in flight: the last step's T copies and their
    gradients, expanded to the query heads on CUDA when heads are grouped (the memory-efficient kernel
    takes a mask but not groups). draft_lm (PackedCausalAttention): q, K, V (expanded likewise) and the
    output per layer."""
    tr = recipe.train
    heads = hc.num_attention_heads
    if hc.head_type == "deepseek_mtp" and _is_deepseek(c):  # MLA runs expanded in training: MHA of qk_head_dim keys
        kv_heads, k_dim, v_dim = heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    else:
        kv_heads, k_dim, v_dim = hc.num_key_value_heads, hc.head_dim, hc.head_dim
    wide = heads if on_gpu and kv_heads != heads else kv_heads
    rows = 2 * tr.batch_tokens
    layers = hc.num_layers if hc.head_type != "deepseek_mtp" else 1
    if hc.head_type == "draft_lm":
        per_row = layers * (heads * (k_dim + v_dim) + wide * (k_dim + v_dim))
        how = f"{layers} layer(s) x (q and output x {heads} heads + K/V x {wide} heads) x (k + v)"
        name = "attention (padded rows)"
    elif on_gpu:
        t = tr.ttt_steps
        per_row = layers * t * (kv_heads * (k_dim + v_dim) + heads * k_dim) + 2 * t * wide * (k_dim + v_dim)
        how = (f"({layers} layer(s) x {t} steps x (own K/V x {kv_heads} heads x (k + v) + q x {heads} heads x k), "
               f"+ the last step's {t} K/V copies x {wide} heads x (k + v) and their gradients, rebuilt in backward)")
        name = "TTT attention (padded rows)"
    else:  # train.ttt_cpu.MergedStep: q, own K/V, merged output, fp32 log-sum-exp and diagonal scores per step
        t = tr.ttt_steps
        kept = layers * t * (kv_heads * (k_dim + v_dim) + heads * (k_dim + v_dim) + heads * (1 + t) * 4 / act)
        # the last step's backward in flight: fp32 dq, K/V gradients of every step, two expanded copies
        flight = (heads * k_dim + 2 * t * kv_heads * (k_dim + v_dim) + 2 * heads * (k_dim + v_dim)) * 4 / act
        per_row = kept + flight
        how = (f"({layers} layer(s) x {t} steps x (own K/V x {kv_heads} heads + q and output x {heads} heads) x "
               f"(k + v) + fp32 log-sum-exp and scores, + the last step's fp32 gradients in backward)")
        name = "TTT attention (padded rows)"
    return Term(name, int(rows * per_row * act),
                f"2 x {tr.batch_tokens:,} padded rows (length buckets) x {how}, k = {k_dim}, v = {v_dim}, x {act} B")


def render(plan: Plan) -> str:
    lines = [f"plan: {plan.recipe} on {plan.device} ({plan.capacity / GB:.0f} GB per device)"]
    lines.extend(f"serves on {s}" for s in plan.serving)
    for ph in plan.phases:
        lines.append(f"\n{ph.name} ({ph.ranks} rank{'s' if ph.ranks != 1 else ''}): "
                     f"{ph.total / GB:.2f} GB per rank, host {ph.host_bytes / GB:.2f} GB per rank while loading")
        for t in ph.terms:
            lines.append(f"  {t.name:<30}{t.bytes / GB:>9.2f} GB  {t.note}")
        lines.extend(f"  note: {n}" for n in ph.notes)
    if plan.disk_bytes_per_token is not None:
        lines.append(f"\nshards: {plan.disk_bytes_per_token:,.0f} bytes per token "
                     f"({plan.disk_bytes_per_token * 1e9 / 1e12:,.1f} TB per billion tokens)")
    lines.append("\nassumptions:")
    lines.extend(f"  - {a}" for a in plan.assumptions)
    refusals = plan.refusals()
    lines.append("\n" + ("does not fit:\n  " + "\n  ".join(refusals) if refusals else "fits: every phase"))
    return "\n".join(lines)


def device_capacity(device: Any) -> tuple[str, float]:
    """(name, GB) of a torch device: a GPU's memory, or this machine's RAM for the CPU."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, props.total_memory / GB
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return "CPU RAM", int(line.split()[1]) * 1024 / GB
    return "CPU RAM", math.inf


def check_fits(recipe: Recipe, target_cfg: dict[str, Any], device: Any, phases: tuple[str, ...], where: str) -> Plan:
    """Refuse, before anything loads, a job whose phases cannot fit this device; -> its plan."""
    name, gb = device_capacity(device)
    plan = make_plan(recipe, target_cfg, device=name, capacity_gb=gb, where=where, phases=phases)
    refusals = plan.refusals()
    if refusals:
        raise PlanError("; ".join(refusals) + f" (headstart plan {recipe.name or 'RECIPE'} shows every term)")
    return plan


def target_config_path(recipe: Recipe) -> Any:
    """The recipe's target config.json: target.model's (an embedded name or a local model directory),
    or, where that directory is not on this machine, the shapes file target.config names."""
    from pathlib import Path

    from headstart.assets import MODELS, resolve_model

    model, shapes = recipe.target.model, recipe.target.config
    if shapes is not None and model not in MODELS and not Path(model).expanduser().is_dir():
        if not Path(shapes).expanduser().is_file():
            raise PlanError(f"target.config {shapes[:200]}: no such file (relative paths are read from the working "
                            f"directory, {Path.cwd()}); and target.model {model[:200]} is not a directory here either: "
                            "fix the path, or pass --target-config CONFIG_JSON")
        return Path(shapes).expanduser()
    return Path(resolve_model(model)) / "config.json"


def check_recipe_fits(recipe: Recipe, phases: tuple[str, ...], device: Any) -> Plan:
    """check_fits with the recipe's own target config.json (train and precompute call it first)."""
    from headstart.fileio import read_json_object

    where = target_config_path(recipe)
    return check_fits(recipe, read_json_object(where, "model config"), device, phases, str(where))
