"""Medusa: k independent residual-MLP heads on the target's last (post-norm) hidden state, no KV cache.

Head j (1..k) reads norm(h_i) at position i and predicts token t_{i+1+j} (the target's own lm_head
predicts t_{i+1}):  z_j = block_j(norm(h_i)), block = n x [z + SiLU(W z + b)], logits_j = lm_head(z_j).
The residual weights start at zero, so every head starts as the target's next-token prediction
(softened, with a draft vocabulary: init_from_target).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headstart.heads.base import TEMPER, DraftHead, PackedBatch, Shifted
from headstart.heads.config import HeadConfig
from headstart.heads.vocab import draft_to_target
from headstart.models.llama import LlamaForCausalLM
from headstart.nn.linear import Linear


class ResBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = Linear(d, d, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(DraftHead):
    def __init__(self, cfg: HeadConfig, target: LlamaForCausalLM) -> None:
        super().__init__(cfg, target)
        d = cfg.hidden_size
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(d) for _ in range(cfg.medusa_num_layers)]) for _ in range(cfg.medusa_num_heads)
        )
        vocab = target.config.vocab_size
        vd = cfg.draft_vocab_size or vocab
        self.lm_head = Linear(d, vd, bias=False) if cfg.draft_vocab_size else None
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))

    def kv_layers(self) -> int:
        return 0

    def target_features(self, hidden: torch.Tensor | None, aux: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            raise ValueError("medusa needs the target's last hidden state")
        return self.target.norm(hidden)

    def forward_heads(self, features: torch.Tensor) -> torch.Tensor:
        """(N, d) post-norm features -> (N, k, d), one state per head."""
        return torch.stack([block(features) for block in self.heads], dim=1)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., V or V_draft)."""
        head = self.lm_head if self.lm_head is not None else self.target.lm_head
        return head(h).float()

    def forward_hidden(self, tokens, features, meta=None, caches=None, backend=None):  # noqa: ANN001
        """Medusa reads features alone (no tokens, no cache): -> (N, k, d), one state per head."""
        return self.forward_heads(features)

    def draft_step(self, tokens, features, meta=None, caches=None, backend=None):  # noqa: ANN001
        """-> (states (N, k, d), logits (N, k, V)); nothing to plan, there is no attention."""
        z = self.forward_heads(features)
        return z, self.compute_logits(z)

    def train_forward(self, batch: PackedBatch) -> tuple[torch.Tensor, Shifted]:
        """-> (states (N, k, d) for every packed row, Shifted rows with one column per head).

        Head j (0-based) at row i predicts t_{i+2+j}: its target distribution is p_{i+1+j} (row
        i+1+j), supervised iff loss_mask[i+2+j] within the same sequence. Shifted.target_rows,
        next_tokens and token_mask are (N, k); rows past a sequence's end have mask 0."""
        if batch.hidden is None:
            raise ValueError("medusa needs the target's last hidden state")
        ids, k = batch.input_ids, len(self.heads)
        n = ids.numel()
        lens = torch.tensor(batch.seq_lens)
        ends = torch.repeat_interleave(lens.cumsum(0), lens)  # (N,) one past each row's sequence end
        rows = torch.arange(n)
        offs = torch.arange(k)
        tgt = rows[:, None] + 1 + offs[None, :]  # (N, k) row of p_{i+1+j}
        nxt = tgt + 1  # (N, k) row of t_{i+2+j}
        ok = nxt < ends[:, None]
        mask = batch.loss_mask if batch.loss_mask is not None else torch.ones(n, dtype=torch.long)
        token_mask = torch.where(ok, mask.long()[nxt.clamp(max=n - 1)], 0)
        next_tokens = torch.where(ok, ids[nxt.clamp(max=n - 1)], -100)
        shifted = Shifted(ids, rows, tgt.clamp(max=n - 1), next_tokens, token_mask, list(batch.seq_lens))
        return self.forward_heads(self.target_features(batch.hidden)), shifted

    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> None:
        """Install the draft vocabulary (draft id i = target id i + d2t[i]) and start the draft
        lm_head from the target's rows for those ids."""
        if d2t.numel() != self.d2t.numel():
            raise ValueError(f"d2t has {d2t.numel()} entries, the draft vocabulary {self.d2t.numel()}")
        self.d2t.copy_(d2t)
        self.init_from_target(self.target.model)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_to_target(draft_ids, self.d2t)

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        """With a draft vocabulary, the draft lm_head starts as the target's rows at TEMPER: head j
        starts as the target's next-token prediction, j positions early, so at full size it is
        confidently wrong. Measured on SmolLM2 (benchmarks/init.py --head medusa, 4 heads, 12
        equal steps): summed held-out KL at the start 23.75 nats (5.9 per head, log V = 10.80)
        against 40.88 at full size; after the steps 19.16 and head-1 top-1 0.091 against 28.57 and
        0.073. Without a draft vocabulary the heads share the target's frozen lm_head, which nothing
        here may scale: they start at full size (the serving layouts have no place for a scale)."""
        if self.lm_head is not None:
            ids = draft_to_target(torch.arange(self.d2t.numel()), self.d2t)
            with torch.no_grad():
                self.lm_head.weight.copy_(target.lm_head.weight[ids] * TEMPER)
