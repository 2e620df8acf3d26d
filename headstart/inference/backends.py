"""Attention backends: `torch` (gather pages + scaled_dot_product_attention; everywhere) and
`flashinfer` (CUDA only, imported lazily). Both read the same AttentionMetadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from headstart.nn.attention import AttentionMetadata, KVPages


@dataclass
class _TorchPlan:
    pages: torch.Tensor  # (B, P) long page ids; keys are gathered a whole page at a time
    kv_width: int  # keys per sequence after the gather (P * page_size, or kv_len for one sequence)
    decode_mask: torch.Tensor | None  # decode steps: (B, 1, 1, kv_width) bool key-padding mask or None
    # Other steps, per sequence: (first query row, q_len, kv_len, mask (q_len, kv_len) or None, causal)
    per_seq: list[tuple[int, int, int, torch.Tensor | None, bool]] | None


class TorchAttention:
    """Gather the pages, then attend with scaled_dot_product_attention (or two matmuls for decode).

    Masks: bottom-right aligned causal (query i of a sequence with q_len queries and kv_len keys sees
    keys j <= kv_len - q_len + i), or a per-sequence custom boolean mask (True = attend).

    Decode steps (one query per sequence) are batched; in bf16/fp16 they use two batched matmuls with
    grouped heads unless the step is one short sequence: measured on the reference CPU, SDPA's bf16
    kernel costs 1.6 ms for 8 sequences x 400 keys (manual: 0.42 ms) and 0.28 ms for one x 512 keys
    (manual: 0.14 ms), but wins for one sequence under ~128 keys (43 vs 86 us); fp32 SDPA wins
    everywhere. Prefill, chunked prefill, verification and mixed steps attend per sequence: a fresh
    prompt uses SDPA's own causal kernel with no mask tensor, which is what makes prefill fast (a
    padded, masked bf16 batch ran at 470 tok/s, per-sequence causal calls at several times that).
    """

    name = "torch"

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> None:
        if "torch" in meta.backend_state:  # target and draft share one plan
            return
        device = meta.positions.device
        q_lens, kv_lens, ps = meta.q_lens_cpu, meta.kv_lens_cpu, meta.page_size
        b = len(q_lens)
        n_pages = -(-max(kv_lens) // ps)
        pages = meta.page_table[:, :n_pages].long().to(device)
        kv_width = kv_lens[0] if b == 1 else n_pages * ps
        if meta.is_decode:
            mask = None
            if b > 1 and min(kv_lens) < kv_width:
                pos = torch.arange(kv_width, device=device)
                mask = (pos.unsqueeze(0) < meta.kv_lens.to(device).unsqueeze(1))[:, None, None, :]
            meta.backend_state["torch"] = _TorchPlan(pages, kv_width, mask, None)
            return
        per_seq = []
        row = 0
        for s, (ql, kv) in enumerate(zip(q_lens, kv_lens)):
            custom = meta.custom_masks[s] if meta.custom_masks is not None else None
            mask = None
            if custom is not None:
                mask = custom.to(device)
            elif 1 < ql < kv:  # a chunk or a verify block over a cache: bottom-right causal
                qpos = torch.arange(ql, device=device).unsqueeze(1) + (kv - ql)
                mask = torch.arange(kv, device=device).unsqueeze(0) <= qpos
            per_seq.append((row, ql, kv, mask, custom is None and ql == kv and ql > 1))
            row += ql
        meta.backend_state["torch"] = _TorchPlan(pages, kv_width, None, per_seq)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPages,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kc, vc = cache  # (P, page, Hkv, Dh)
        hkv, dh = kc.shape[2], kc.shape[3]
        kc.view(-1, hkv, dh).index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.view(-1, hkv, dh).index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        plan: _TorchPlan = meta.backend_state["torch"]
        b = plan.pages.shape[0]
        keys = kc[plan.pages].view(b, -1, hkv, dh)[:, : plan.kv_width]  # (B, L, Hkv, Dh)
        values = vc[plan.pages].view(b, -1, hkv, dh)[:, : plan.kv_width]
        gqa = q.shape[1] != hkv
        if plan.per_seq is None:
            if keys.dtype != torch.float32 and (b > 1 or plan.kv_width > 128):
                return _decode_attention(q, keys, values, plan.decode_mask, scale)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=plan.decode_mask,
                scale=scale, enable_gqa=gqa,
            )  # (B, Hq, 1, Dh)
            return out.squeeze(2)
        outs = []
        for s, (row, ql, kv, mask, causal) in enumerate(plan.per_seq):
            qs = q[row:row + ql].transpose(0, 1).unsqueeze(0)  # (1, Hq, q_len, Dh)
            ks = keys[s, :kv].transpose(0, 1).unsqueeze(0)  # (1, Hkv, kv_len, Dh)
            vs = values[s, :kv].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale,
                                               enable_gqa=gqa)  # (1, Hq, q_len, Dh)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """One query per sequence: q (B, Hq, Dh), keys/values (B, L, Hkv, Dh) -> (B, Hq, Dh).

    Query heads are grouped by their KV head (GQA) so K/V are never repeated; softmax runs in fp32.
    """
    b, hq, dh = q.shape
    hkv = keys.shape[2]
    qg = q.view(b, hkv, hq // hkv, dh)  # (B, Hkv, G, Dh)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * scale  # (B, Hkv, G, L)
    if mask is not None:
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    probs = scores.softmax(-1).to(values.dtype)
    out = torch.matmul(probs, values.transpose(1, 2))  # (B, Hkv, G, Dh)
    return out.reshape(b, hq, dh)


class FlashInferAttention:
    """FlashInfer's paged prefill wrapper over the same metadata (CUDA only; imported lazily).

    The page table handed to FlashInfer already includes the step's new tokens: K/V are written into
    the pages first (by slot), then the wrapper attends over kv_len keys per sequence. Custom masks
    (trees) go through FlashInfer's packed custom-mask path.
    """

    name = "flashinfer"

    def __init__(self, device: torch.device, workspace_mb: int = 128) -> None:
        import flashinfer  # noqa: F401 - fail early with a clear message if missing

        self._flashinfer = flashinfer
        self._workspace = torch.empty(workspace_mb * 1024 * 1024, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple, object] = {}

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> None:
        key = (num_q_heads, num_kv_heads, head_dim, dtype)
        state = meta.backend_state.setdefault("flashinfer", {})
        if key in state:
            return
        # Hopper's FA3 prefill kernel has no custom-mask support ("operation not supported" on an
        # H200): tree steps plan FlashInfer's FA2 kernels, everything else lets FlashInfer choose.
        kernel = "fa2" if meta.custom_masks is not None else "auto"
        wrapper = self._wrappers.get((*key, kernel))
        if wrapper is None:
            wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD",
                                                                           backend=kernel)
            self._wrappers[(*key, kernel)] = wrapper
        device = meta.positions.device
        ps = meta.page_size
        pages = [-(-kv // ps) for kv in meta.kv_lens_cpu]
        table = meta.page_table.to(device)
        indices = torch.cat([table[b, :n] for b, n in enumerate(pages)]).int()
        indptr = torch.tensor([0] + pages, device=device).cumsum(0).int()
        last = torch.tensor([kv - (n - 1) * ps for kv, n in zip(meta.kv_lens_cpu, pages)], device=device).int()
        custom = None
        if meta.custom_masks is not None:
            parts = []
            for s, m in enumerate(meta.custom_masks):
                q_len, kv_len = meta.q_lens_cpu[s], meta.kv_lens_cpu[s]
                if m is None:  # causal, bottom-right aligned
                    qi = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
                    m = torch.arange(kv_len, device=device).unsqueeze(0) <= qi
                parts.append(m.to(device).flatten())
            custom = torch.cat(parts)
        wrapper.plan(
            meta.qo_indptr.to(device).int(), indptr, indices, last, num_q_heads, num_kv_heads, head_dim, ps,
            causal=custom is None, custom_mask=custom, q_data_type=dtype, kv_data_type=dtype,
            sm_scale=head_dim**-0.5,
        )
        state[key] = wrapper

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPages,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kc, vc = cache
        hkv, dh = kc.shape[2], kc.shape[3]
        kc.view(-1, hkv, dh).index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.view(-1, hkv, dh).index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        wrapper = meta.backend_state["flashinfer"][(q.shape[1], hkv, dh, q.dtype)]
        planned = dh**-0.5  # the softmax scale the plan was made with
        if scale != planned:  # q * (scale / planned) . k * planned = q . k * scale
            q = q * (scale / planned)
        return wrapper.run(q.contiguous(), (kc, vc))


def make_backend(name: str, device: torch.device) -> TorchAttention | FlashInferAttention:
    """`auto` picks FlashInfer on CUDA when it is installed, torch otherwise."""
    if name == "auto":
        if device.type == "cuda":
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError:
                name = "torch"
        else:
            name = "torch"
    if name == "torch":
        return TorchAttention()
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer backend needs a CUDA device; use --backend torch on CPU")
        try:
            return FlashInferAttention(device)
        except ImportError:
            raise ValueError("the flashinfer backend needs `pip install -e '.[cuda]'` (flashinfer-python)") from None
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or flashinfer")
