"""Sizing rules the trainer runs by and `headstart plan` counts with: the rows of one chunk of the
distillation loss (train.losses) and the bytes each of its rows keeps; the KV pages the engines of validation
and eval allocate. One definition, below both: plan must predict what the trainer and the engine will take.
"""

from __future__ import annotations

import math

CPU_LOSS_CHUNK = 256  # rows: the logits of a chunk stay in the CPU's caches
LOSS_CHUNK_GPU_BYTES = 2 << 30  # a GPU's chunk: its live fp32 logits (every TTT step's log q, the teacher's, a grad)
QUANT_ROWS = 2048  # precompute's fp8 quantisation: rows at a time, so its fp32 copies stay small on any device
FLASHINFER_WORKSPACE_MB = 128  # the buffer the FlashInfer backend hands its wrappers, one per backend
# Where acceptance is measured (eval, validation) every prompt of a batch group prefills in one step, up to this
# many tokens (inference.scheduler): a one-step prefill holds every prompt token's activations at once (logits only
# for each prompt's last row), Llama-3.1-8B's MLP at 16,384 tokens ~1.4 GB in bf16.
MEASURED_PREFILL_CAP = 16_384
KV_PAGE_TOKENS = 16  # the KV page of the engines validation and eval build (plan counts their pages with it)
KV_SPARE_PAGES = 8  # scheduler.kv_pages_for's pages beyond its sequences' own
EVAL_BATCH = 8  # `headstart eval`'s default --batch-size (evaluate.EvalPlan): the sequences its engine holds at once


def grad_components(loss: str) -> tuple[int, ...]:
    """Which of a TTT step's loss terms [KL, sum of a, sum of -log a] the objective of train.loss differentiates
    (train.losses.objective): the fused CPU loss keeps the gradients of these only."""
    return {"kl": (0,), "lk_alpha": (2,)}.get(loss, (0, 1))


def chunk_row_bytes(vocab: int, loss_steps: int, lk: bool = False, full_vocab: int | None = None) -> int:
    """The fp32 bytes one row of a loss chunk keeps: KL, (loss_steps + 3) logit rows (every step's log q, the
    teacher's log p and p, a gradient); the LK losses add each step's q and the teacher's p on the draft
    vocabulary, and with a draft vocabulary the teacher's full-vocabulary logits and softmax."""
    if not lk:
        return (loss_steps + 3) * vocab * 4
    full = 2 * full_vocab * 4 if full_vocab and full_vocab != vocab else 0
    return (2 * loss_steps + 4) * vocab * 4 + full


def loss_chunk_rows(configured: int | None, vocab: int, loss_steps: int, device_type: str, rows: int,
                    lk: bool = False, full_vocab: int | None = None) -> int:
    """Rows per chunk of the loss: `configured` if set; else 256 on CPU, and on a GPU as many as keep the
    chunk's rows (chunk_row_bytes) under LOSS_CHUNK_GPU_BYTES (whole 256-row blocks, at least one, at most
    the micro-batch): each chunk is a forward, a recompute and a backward of the lm_head and the loss, so
    fewer chunks are fewer launches (`headstart plan` counts the same bytes)."""
    if configured is not None:
        return configured
    if device_type == "cpu":
        return CPU_LOSS_CHUNK
    fit = LOSS_CHUNK_GPU_BYTES // chunk_row_bytes(vocab, loss_steps, lk, full_vocab)
    return max(CPU_LOSS_CHUNK, min(-(-rows // CPU_LOSS_CHUNK) * CPU_LOSS_CHUNK, fit // CPU_LOSS_CHUNK * CPU_LOSS_CHUNK))


def engine_kv_tokens(sequences: int, prompt_tokens: int, new_tokens: int, lookahead: int,
                     cap: int | None = MEASURED_PREFILL_CAP) -> tuple[int, str]:
    """(KV tokens, how) an acceptance-measuring engine can hold at most: `sequences` prompts of under
    `prompt_tokens` tokens, each + `new_tokens` and the speculation's `lookahead`, sized as scheduler.kv_pages_for
    sizes it for the ones that run together. Eval (cap None) runs a batch group of `sequences` at once.
    Validation (validate.engine_acceptance) runs them all at once if they hold at most the one-step prefill cap C,
    else batch = prompts x C // total at a time, sized for the `batch` longest: their prompt tokens are at most
    min(batch x L, total), whose largest value over every total in (C, prompts x L] is at most
    sqrt(prompts x C x L), which lies between C and prompts x L. Each sequence also gets kv_pages_for's slack
    (its tokens + lookahead + 1 rounded up to whole pages, and one more page), the cache 8 spare pages."""
    page = KV_PAGE_TOKENS
    per_seq = new_tokens + lookahead + 2 * page  # ceil((n + lookahead + 1) / page) + 1 pages <= n + lookahead + 2 page
    whole, spare = sequences * prompt_tokens, KV_SPARE_PAGES * page
    if cap is None or whole <= cap:
        return whole + sequences * per_seq + spare, (f"{sequences} x {prompt_tokens + per_seq:,} tokens (prompt, "
                                                     f"{new_tokens:,} new, lookahead {lookahead}, whole pages) + "
                                                     f"{spare} spare")
    held = math.isqrt(sequences * cap * prompt_tokens - 1) + 1  # in (cap, whole): the bound in the docstring
    return held + sequences * per_seq + spare, (f"{sequences} prompts, at most {held:,} prompt tokens at once under "
                                                f"the {cap:,}-token prefill cap, + {per_seq:,} each, + {spare} spare")
