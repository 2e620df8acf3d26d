"""DFlash: a block-parallel drafter. One forward fills a block [anchor, mask, ..., mask] of
`block_size` positions; slot i > 0 drafts the token at anchor + i, so a step drafts block_size - 1
tokens with one drafter forward and one lm_head pass (speculators' `dflash`, vLLM `method: dflash`).

    c_p = hidden_norm(fc(cat(aux states at p)))          context state of each verified position p
    per layer l:  K/V of position p < a: k_norm(k_proj_l(c_p)), v_proj_l(c_p) (RoPE at p), no query
                  the block: a Qwen3 decoder layer over x (input norm, q/k norm, gated MLP) whose
                  queries attend to the context keys before a and to every key of the block
    x_0 = embed([t_a, m, ..., m]) at positions a .. a + bs - 1   (the target's frozen embedding)
    logits = lm_head(norm(x_L))                           (the target's frozen rows; a draft vocab)

The context keys read the fused target states directly (not the block's residual stream), so the
engine writes them into the drafter's paged cache once per verified position (`write_context`) and
each step runs only the block. Training runs the same layers over anchored blocks of packed
sequences (`train_blocks`), the context keys of each layer computed by the same `context_kv`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from headstart.heads.base import TEMPER, PackedBatch, SharedVocabHead, copy_layer
from headstart.heads.config import HeadConfig
from headstart.models.llama import LlamaForCausalLM
from headstart.nn.attention import (
    Attention,
    AttentionBackend,
    AttentionMetadata,
    KVPages,
    PaddedLayout,
    additive_mask,
    fused_kv,
    packed_metadata,
)
from headstart.nn.decoder import DecoderLayer
from headstart.nn.linear import Linear
from headstart.nn.norm import RMSNorm


def context_kv(attn: Attention, states: torch.Tensor, positions: torch.Tensor,
               step_cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, d) context states -> this layer's keys (normed, rotated) and values, (N, Hkv, Dh) each."""
    n = states.shape[0]
    _, k, v = attn.qkv_proj(states).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    k = k.view(n, attn.num_kv_heads, attn.head_dim)
    v = v.view(n, attn.num_kv_heads, attn.head_dim)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    _, k = attn.rope(k[:, :0], k, positions, step_cache)
    return k, v


@dataclass
class AnchoredBlocks:
    """A micro-batch's training blocks: anchor j of sequence s covers packed rows anchors[j] + i."""

    anchors: torch.Tensor  # (A,) packed row of each anchor, sorted
    seq_of: torch.Tensor  # (A,) the sequence each anchor lies in
    block_size: int

    @property
    def rows(self) -> torch.Tensor:
        """(A * bs,) the packed row each block slot stands at (anchor + slot)."""
        return (self.anchors[:, None] + torch.arange(self.block_size)).reshape(-1)


def choose_anchors(batch: PackedBatch, block_size: int, max_anchors: int, generator: torch.Generator,
                   heldout: bool = False) -> AnchoredBlocks | None:
    """Random anchors over the packed micro-batch (speculators' `select_anchors`, per sequence):
    a row whose token is supervised and whose whole block stays inside its sequence, so slot i's
    target, the target's prediction at anchor + i - 1, exists. At most `max_anchors`, sorted."""
    mask = batch.loss_mask if batch.loss_mask is not None else torch.ones(batch.input_ids.numel(), dtype=torch.long)
    valid, seq_of, start = [], [], 0
    for s, n in enumerate(batch.seq_lens):
        if n >= block_size:
            rows = start + torch.nonzero(mask[start:start + n - block_size + 1].cpu() > 0).flatten()
            valid.append(rows)
            seq_of.append(torch.full_like(rows, s))
        start += n
    if not valid or not sum(v.numel() for v in valid):
        return None
    rows, seqs = torch.cat(valid), torch.cat(seq_of)
    if rows.numel() > max_anchors:
        pick = torch.randperm(rows.numel(), generator=generator)[:max_anchors] if not heldout else \
            torch.linspace(0, rows.numel() - 1, max_anchors).long()  # held out: evenly spread, no draw
        pick = pick.sort().values
        rows, seqs = rows[pick], seqs[pick]
    return AnchoredBlocks(rows, seqs, block_size)


@dataclass
class _BlockLayout:
    """A micro-batch's blocks laid out for one attention call per layer and bucket (the sequences holding
    blocks, bucketed by length and then by block rows as `PaddedLayout` does: under 2x padding of each): per bucket
    the context rows padded (B_b, L_b), each sequence's block rows padded (B_b, Q_b), and one additive
    mask (B_b, 1, Q_b, L_b + Q_b) shared by the layers: a block query sees the context before its anchor
    and its own block. Padding queries see only themselves (a fully masked row would give NaN to the
    backward pass). Sequences without a block are left out."""

    context: PaddedLayout
    blocks: PaddedLayout
    allowed: list[torch.Tensor]  # per bucket (B_b, Q_b, L_b + Q_b) bool
    masks: dict

    def mask(self, dtype: torch.dtype) -> list[torch.Tensor]:
        if dtype not in self.masks:
            self.masks[dtype] = [additive_mask(a, dtype).unsqueeze(1) for a in self.allowed]  # (B_b, 1, Q_b, .)
        return self.masks[dtype]


def _block_layout(batch: PackedBatch, blocks: AnchoredBlocks, device: torch.device) -> _BlockLayout:
    """Built on the host from the lengths and anchors (no device sync; host loops over the buckets' members)."""
    bs, lens = blocks.block_size, list(batch.seq_lens)
    counts = torch.bincount(blocks.seq_of, minlength=len(lens)) * bs  # (B,) block rows per sequence (host)
    # Buckets of the sequences with blocks by length, each split by block rows: within a bucket both the
    # contexts and the block rows pad to under twice their own size.
    rows = counts.tolist()
    groups = [sub for group in PaddedLayout.buckets([n if c else 0 for n, c in zip(lens, rows)])
              for sub in PaddedLayout.buckets([rows[i] if i in group else 0 for i in range(len(lens))])]
    context = PaddedLayout.of(lens, device, groups=groups)
    block_rows = PaddedLayout.of(rows, device, groups=groups)
    first = torch.cumsum(counts, 0) - counts  # (B,) first block row of each sequence
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    anchor_pos = torch.repeat_interleave(blocks.anchors - starts[blocks.seq_of], bs)  # (A * bs,) per block row
    anchor_pos = torch.cat([anchor_pos, torch.zeros(1, dtype=torch.long)])  # + padding's
    allowed = []
    for group, length in zip(groups, context.lengths):
        seqs = torch.tensor(group)
        n_q = counts[seqs]
        col = torch.arange(int(n_q.max()))
        inside = col[None, :] < n_q[:, None]  # (B_b, Q_b)
        row = torch.where(inside, first[seqs][:, None] + col[None, :], anchor_pos.numel() - 1)  # block row, or padding
        ctx = torch.arange(length)[None, None, :] < anchor_pos[row][:, :, None]  # (B_b, Q_b, L_b): before the anchor
        blk = torch.where(inside, col[None, :] // bs, -1)
        own = (blk[:, :, None] == blk[:, None, :]) & inside[:, :, None]  # (B_b, Q_b, Q_b): its own block
        own |= torch.eye(col.numel(), dtype=torch.bool)[None] & ~inside[:, :, None]  # padding sees itself
        allowed.append(torch.cat([ctx, own], dim=2).to(device, non_blocking=True))
    return _BlockLayout(context, block_rows, allowed, {})


class _BlockTrainingAttention:
    """Training backend of one drafter layer: the block queries of each length bucket in one attention
    call, over that layer's context keys (positions before the block's anchor) and their own block's
    keys. The context K/V are computed here, inside the layer's forward, where FSDP has gathered its
    weights."""

    name = "dflash-train"

    def __init__(self, attn: Attention, states: torch.Tensor, positions: torch.Tensor, layout: _BlockLayout) -> None:
        self.attn, self.states, self.positions, self.layout = attn, states, positions, layout

    @torch.compiler.disable  # bucket shapes change with every micro-batch: one graph break, not a recompile each
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPages | None,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ctx_k, ctx_v = context_kv(self.attn, self.states, self.positions)  # (N, Hkv, Dh)
        lay = self.layout
        outs = []
        for ck, cv, bk, bv, bq, mask in zip(lay.context.pad(ctx_k), lay.context.pad(ctx_v), lay.blocks.pad(k),
                                            lay.blocks.pad(v), lay.blocks.pad(q), lay.mask(q.dtype)):
            # keys (B_b, L_b + Q_b, Hkv or Hq, Dh): the context, then the bucket's block rows
            keys, values, gqa = fused_kv(q, torch.cat([ck, bk], dim=1), torch.cat([cv, bv], dim=1))
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                bq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale,
                enable_gqa=gqa).transpose(1, 2))  # (B_b, Q_b, H, Dh)
        return lay.blocks.unpad(outs)  # (A * bs, H, Dh)


class DFlashHead(SharedVocabHead):
    def __init__(self, cfg: HeadConfig, target: LlamaForCausalLM) -> None:
        super().__init__(cfg, target)
        d, eps = cfg.hidden_size, target.config.rms_norm_eps
        a = len(cfg.aux_layer_ids)
        self.fc = Linear(a * target.config.hidden_size, d, bias=False)
        self.hidden_norm = RMSNorm(d, eps)
        self.rotary = self.make_rotary(target)
        # Qwen3 layers whatever the target's family: q/k norms, no biases (speculators' layer).
        layer = cfg.layer_config(target, qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False)
        self.layers = nn.ModuleList(DecoderLayer(layer, self.rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, eps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def target_features(self, hidden: torch.Tensor | None, aux: torch.Tensor | None = None) -> torch.Tensor:
        """(N, A, d) aux states -> the context states c (N, d)."""
        if aux is None:
            raise ValueError(f"dflash needs the hidden states entering layers {self.config.aux_layer_ids}")
        n, a, d = aux.shape
        return self.hidden_norm(self.fc(aux.reshape(n, a * d).to(self.fc.weight.dtype)))

    def write_context(self, states: torch.Tensor, meta: AttentionMetadata, caches: list[KVPages]) -> None:
        """Write every layer's context K/V for the positions of `meta` (no query runs)."""
        for layer, (kc, vc) in zip(self.layers, caches):
            k, v = context_kv(layer.self_attn, states, meta.positions, meta.step_cache)
            kc.view(-1, kc.shape[2], kc.shape[3]).index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
            vc.view(-1, vc.shape[2], vc.shape[3]).index_copy_(0, meta.slot_mapping, v.to(vc.dtype))

    def block_tokens(self, anchor_tokens: list[int], slots: int) -> list[int]:
        """[t_a, m, ..., m] for each anchor, `slots` positions per block."""
        return [t for a in anchor_tokens for t in [a] + [self.mask_token_id] * (slots - 1)]

    def forward_hidden(self, tokens: torch.Tensor, features: torch.Tensor | None, meta: AttentionMetadata,
                       caches: list[KVPages] | None, backend: AttentionBackend | list) -> torch.Tensor:
        """The block's tokens (N,) -> drafter states (N, d) before the final norm. The context is in
        `caches` (engine) or, in training, one backend per layer holds it (`backend` a list)."""
        x = self.embed(tokens)
        for j, layer in enumerate(self.layers):
            b = backend[j] if isinstance(backend, list) else backend
            x = layer(x, meta, caches[j] if caches is not None else None, b)
        return x

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(self.norm(h))

    def train_forward(self, batch: PackedBatch) -> tuple[torch.Tensor, object]:
        raise TypeError("a dflash head trains on anchored blocks, not shifted rows: use train_blocks(batch, blocks)")

    def train_blocks(self, batch: PackedBatch, blocks: AnchoredBlocks) -> torch.Tensor:
        """Packed sequences and their anchored blocks (`choose_anchors`) -> drafter states (A * bs, d),
        block after block (bs = blocks.block_size: the head's own, in training and in the engine, which
        drafts from the first k slots at any k). Slot i of anchor a is supervised by the target's
        prediction at a + i - 1 (packed row), iff loss_mask[a + i] and i > 0."""
        device = batch.aux_hidden.device
        states = self.target_features(None, batch.aux_hidden)  # (N, d)
        positions = packed_metadata(batch.seq_lens, device=device).positions
        bs = blocks.block_size
        tokens = torch.full((blocks.anchors.numel(), bs), self.mask_token_id, dtype=torch.long, device=device)
        tokens[:, 0] = batch.input_ids[blocks.anchors.to(batch.input_ids.device, non_blocking=True)].to(device)
        rows = blocks.rows.to(device, non_blocking=True)
        meta = packed_metadata([int(rows.numel())], device=device)
        meta.positions = positions[rows]
        layout = _block_layout(batch, blocks, device)
        backends = [_BlockTrainingAttention(layer.self_attn, states, positions, layout) for layer in self.layers]
        return self.forward_hidden(tokens.reshape(-1).to(device), None, meta, None, backends)

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        """Layers copied from the target's last ones where shapes match (q/k norms start at one), fc
        passing the deepest aux state through (the identity on its block), the final norm the
        target's at TEMPER (a copy of the target's prediction at the wrong place: see TEMPER)."""
        n = len(target.model.layers)
        for i, layer in enumerate(self.layers):
            copy_layer(layer, target.model.layers[n - len(self.layers) + i])
        d = target.config.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            if self.fc.weight.shape[0] == d:
                self.fc.weight[:, -d:] = torch.eye(d, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
            self.norm.weight.copy_(target.model.norm.weight * TEMPER)
