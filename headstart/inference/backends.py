"""Attention backends: `torch` (gather pages + scaled_dot_product_attention; everywhere) and
`flashinfer` (CUDA only, imported lazily). Both read the same AttentionMetadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from headstart.nn.attention import AttentionMetadata, KVPages


@dataclass
class _TorchPlan:
    q_index: torch.Tensor | None  # (B, max_q) rows of q per padded query slot; None = decode fast path
    out_index: torch.Tensor | None  # (N,) flat padded slot of each real query row
    kv_index: torch.Tensor  # (B, max_kv) flat cache slot per padded KV position
    mask: torch.Tensor | None  # (B, 1, max_q, max_kv) bool, True = attend; None = no mask needed
    is_causal: bool  # single fresh sequence: SDPA's own causal mask is exact


class TorchAttention:
    """Pages are gathered into a padded (B, max_kv) batch; one SDPA call per layer for the whole step.

    Masks: bottom-right aligned causal (query i of a sequence with q_len queries and kv_len keys sees
    keys j <= kv_len - q_len + i), or a per-sequence custom boolean mask (True = attend).
    """

    name = "torch"

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> None:
        if "torch" in meta.backend_state:  # target and draft share one plan
            return
        device = meta.positions.device
        q_lens, kv_lens, ps = meta.q_lens_cpu, meta.kv_lens_cpu, meta.page_size
        b, max_q, max_kv = len(q_lens), max(q_lens), max(kv_lens)
        pos = torch.arange(max_kv, device=device)
        table = meta.page_table.long()
        kv_index = table.gather(1, (pos // ps).clamp(max=table.shape[1] - 1).expand(b, -1)) * ps + pos % ps
        kv_valid = pos.unsqueeze(0) < meta.kv_lens.to(device).unsqueeze(1)  # (B, max_kv)
        kv_index = torch.where(kv_valid, kv_index, torch.zeros_like(kv_index))
        fresh_single = b == 1 and q_lens[0] == kv_lens[0] and meta.custom_masks is None
        if max_q == 1 and meta.custom_masks is None:
            mask = None if b == 1 or min(kv_lens) == max_kv else kv_valid[:, None, None, :]
            meta.backend_state["torch"] = _TorchPlan(None, None, kv_index, mask, False)
            return
        qi = torch.arange(max_q, device=device)
        starts = meta.qo_indptr[:-1].long().to(device)
        q_len_t = torch.tensor(q_lens, device=device)
        q_valid = qi.unsqueeze(0) < q_len_t.unsqueeze(1)  # (B, max_q)
        q_index = torch.where(q_valid, starts.unsqueeze(1) + qi, torch.zeros_like(qi))
        out_index = (torch.arange(b, device=device).unsqueeze(1) * max_q + qi).masked_select(q_valid)
        mask = None
        if not fresh_single:
            # Query i sits at absolute position kv_len - q_len + i.
            qpos = (meta.kv_lens.to(device) - q_len_t).unsqueeze(1) + qi  # (B, max_q)
            mask = (pos.view(1, 1, -1) <= qpos.unsqueeze(-1)) & kv_valid.unsqueeze(1)  # (B, max_q, max_kv)
            if meta.custom_masks is not None:
                for s, m in enumerate(meta.custom_masks):
                    if m is not None:
                        mask[s, : q_lens[s], : kv_lens[s]] = m.to(device)
            mask[:, :, 0] |= ~q_valid  # padded query rows attend to one key: no NaN rows
            mask = mask.unsqueeze(1)
        meta.backend_state["torch"] = _TorchPlan(q_index, out_index, kv_index, mask, fresh_single)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPages,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kc, vc = cache  # (P, page, Hkv, Dh)
        hkv, dh = kc.shape[2], kc.shape[3]
        k_flat, v_flat = kc.view(-1, hkv, dh), vc.view(-1, hkv, dh)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        plan: _TorchPlan = meta.backend_state["torch"]
        keys = k_flat[plan.kv_index].transpose(1, 2)  # (B, Hkv, max_kv, Dh)
        values = v_flat[plan.kv_index].transpose(1, 2)
        if plan.q_index is None:
            queries = q.unsqueeze(2)  # (B, Hq, 1, Dh)
        else:
            queries = q[plan.q_index].transpose(1, 2)  # (B, Hq, max_q, Dh)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=plan.mask, is_causal=plan.is_causal, scale=scale,
            enable_gqa=queries.shape[1] != keys.shape[1],
        )  # (B, Hq, max_q, Dh)
        out = out.transpose(1, 2)  # (B, max_q, Hq, Dh)
        if plan.q_index is None:
            return out.squeeze(1)
        return out.reshape(-1, out.shape[2], out.shape[3])[plan.out_index]


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
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")
            self._wrappers[key] = wrapper
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
        )
        state[key] = wrapper

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPages,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kc, vc = cache
        hkv, dh = kc.shape[2], kc.shape[3]
        kc.view(-1, hkv, dh).index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.view(-1, hkv, dh).index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        wrapper = meta.backend_state["flashinfer"][(q.shape[1], hkv, dh, q.dtype)]
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
