"""Sampling: the one place that turns logits into the processed distribution p, and draws from it.

Order (as HF's generate): repetition penalty -> temperature -> top-k -> top-p -> min-p. Greedy
(temperature 0) makes p one-hot at the argmax, so speculative acceptance rules apply unchanged.
Draws use one float64 uniform per token from the request's own torch.Generator: the same seed
gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class SamplingParams:
    max_tokens: int = 128  # new tokens at most
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with probability >= top_p
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    min_p: float = 0.0  # drop tokens with p < min_p * p_max
    repetition_penalty: float = 1.0  # HF-style: divides positive / multiplies negative logits of seen tokens
    seed: int | None = None  # per-request generator seed (None: from the engine's seed and request order)
    stop: list[str] = field(default_factory=list)  # stop strings (excluded from the text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # return the sampled token's logprob and this many top alternatives

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0 or math.isinf(self.temperature):  # NaN fails every comparison
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty (an empty one would stop after the first token)")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]] | None = None
) -> torch.Tensor:
    """logits (B, V) fp32 -> p (B, V) fp32, the distribution tokens are drawn from (one-hot if greedy)."""
    logits = logits.float()
    if any(p.repetition_penalty != 1.0 for p in params):
        logits = logits.clone()
        for b, p in enumerate(params):
            if p.repetition_penalty != 1.0 and histories and histories[b]:
                seen = torch.tensor(sorted(set(histories[b])), device=logits.device)
                vals = logits[b, seen]
                logits[b, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    out = torch.empty_like(logits)
    greedy = [b for b, p in enumerate(params) if p.greedy]
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if greedy:
        g = torch.tensor(greedy, device=logits.device)
        out[g] = 0.0
        out[g, logits[g].argmax(-1)] = 1.0
    if sampled:
        s = torch.tensor(sampled, device=logits.device)
        sub = [params[b] for b in sampled]
        x = logits[s] / torch.tensor([p.temperature for p in sub], device=logits.device).unsqueeze(1)
        x = _top_k(x, [p.top_k for p in sub])
        probs = torch.softmax(x, dim=-1)
        probs = _top_p(probs, [p.top_p for p in sub])
        probs = _min_p(probs, [p.min_p for p in sub])
        out[s] = probs / probs.sum(-1, keepdim=True)
    return out


def _top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    if not any(0 < k < x.shape[-1] for k in ks):
        return x
    kmax = min(max(ks), x.shape[-1])
    top = x.topk(kmax, dim=-1).values  # (B, kmax) descending
    idx = torch.tensor([(k if 0 < k < x.shape[-1] else kmax) - 1 for k in ks], device=x.device).clamp(max=kmax - 1)
    thresh = top.gather(1, idx.unsqueeze(1))
    keep_all = torch.tensor([not 0 < k < x.shape[-1] for k in ks], device=x.device).unsqueeze(1)
    return torch.where((x >= thresh) | keep_all, x, torch.full_like(x, float("-inf")))


def _top_p(probs: torch.Tensor, ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in ps):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    limit = torch.tensor(ps, device=probs.device).unsqueeze(1)
    drop_sorted = before >= limit  # the first token is always kept (before = 0 < limit)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


def _min_p(probs: torch.Tensor, ms: list[float]) -> torch.Tensor:
    if all(m == 0.0 for m in ms):
        return probs
    m = torch.tensor(ms, device=probs.device).unsqueeze(1)
    return probs.masked_fill(probs < m * probs.max(-1, keepdim=True).values, 0.0)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row by inverse CDF with a float64 uniform from each row's generator; (B,) int64."""
    b = probs.shape[0]
    u = torch.empty(b, dtype=torch.float64)
    for i, g in enumerate(generators):
        u[i] = torch.rand((), generator=g, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    u = u.to(probs.device) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1)
    # A uniform that lands exactly on a zero-probability tail cannot pick it: clamp to the last
    # token with mass.
    last = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(tokens, last)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    histories: list[list[int]] | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,). Greedy rows take the argmax and consume no random draw."""
    if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
        return logits.argmax(-1)  # the common decode case: no one-hot distribution to build
    probs = processed_probs(logits, params, histories)
    tokens = probs.argmax(-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if rows:
        drawn = draw(probs[rows], [generators[b] for b in rows])
        tokens[torch.tensor(rows, device=tokens.device)] = drawn
    return tokens


def rows_logprobs(params: SamplingParams, logits: torch.Tensor, rows: list[int], tokens: list[int]
                  ) -> list[dict] | None:
    """Log-probabilities of tokens emitted from `rows` of a verify step's logits, if the request asked."""
    if params.logprobs is None:
        return None
    return token_logprobs(logits[rows], torch.tensor(tokens), params.logprobs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> list[dict]:
    """Per row: the chosen token's log-probability under the raw model distribution, and the top n."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for b in range(logits.shape[0]):
        entry = {"token_id": int(tokens[b]), "logprob": float(logp[b, tokens[b]])}
        if top_n:
            vals, ids = logp[b].topk(top_n)
            entry["top"] = [(int(i), float(v)) for i, v in zip(ids, vals)]
        out.append(entry)
    return out
