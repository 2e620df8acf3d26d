"""Attention backends: `torch` (gather pages + scaled_dot_product_attention; everywhere) and
`flashinfer` (CUDA only, imported lazily). Both read the same AttentionMetadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from headstart.kernels import MAX_ROWS, kernel_dtype_ok, mask_key_sets
from headstart.kernels import rowwise as rowwise_kernels
from headstart.nn.attention import AttentionMetadata, KVPages
from headstart.sizing import FLASHINFER_WORKSPACE_MB


@dataclass
class _TorchPlan:
    pages: torch.Tensor  # (B, P) long page ids; keys are gathered a whole page at a time
    kv_width: int  # keys per sequence after the gather (P * page_size, or kv_len for one sequence)
    decode_mask: torch.Tensor | None  # decode steps: (B, 1, 1, kv_width) bool key-padding mask or None
    # Other steps, per sequence: (first query row, q_len, kv_len, mask (q_len, kv_len) or None, causal)
    per_seq: list[tuple[int, int, int, torch.Tensor | None, bool]] | None


@dataclass
class _RowPlan:
    """Rows attended by the row-invariant kernel: row r of `rows` sees keys [0, lens[r]) of sequence
    seq[r], then the KV indices extra[r, :extra_lens[r]]. Sequences in `per_seq` (long chunks) use SDPA."""

    rows: torch.Tensor | None  # indices of the kernel's rows in the step (None: every row)
    seq: torch.Tensor
    lens: torch.Tensor
    extra: torch.Tensor
    extra_lens: torch.Tensor
    table: torch.Tensor
    per_seq: list[tuple[int, int, int, int, torch.Tensor | None, bool]]  # (seq, row, q_len, kv_len, mask, causal)


class TorchAttention:
    """Attention over the paged cache with torch (CPU, or CUDA without FlashInfer).

    Masks: bottom-right aligned causal (query i of a sequence with q_len queries and kv_len keys sees
    keys j <= kv_len - q_len + i), or a per-sequence custom boolean mask (True = attend).

    With the row-invariant CPU kernels (headstart.kernels; `rowwise=True`, the engine's default on
    CPU), every query (with max_rows=None), or every query of a sequence with at most max_rows queries
    in the step (decode, verify, tree nodes, short chunks), is attended on its own, straight from the
    pages, with a reduction order that depends only on its own key set: a token gets the same bits
    alone, in a batch, in a verify block or in any prefill chunk, and a tree node sees the same keys in
    the same order as the AR step at its position. Longer chunks otherwise keep SDPA's causal kernel
    (several times faster for long prompts, but its bits depend on where the chunk starts).

    Without them: decode steps (one query per sequence) are batched; in bf16/fp16 they use two
    batched matmuls with grouped heads unless the step is one short sequence (measured on the
    reference CPU, SDPA's bf16 kernel costs 1.6 ms for 8 sequences x 400 keys against 0.42 ms, but
    wins for one sequence under ~128 keys); fp32 SDPA wins everywhere. Prefill, chunked prefill,
    verification and mixed steps attend per sequence: a fresh prompt uses SDPA's own causal kernel
    with no mask tensor, which is what makes prefill fast.
    """

    name = "torch"

    def __init__(self, rowwise: bool = False, max_rows: int | None = MAX_ROWS) -> None:
        self.rowwise = rowwise
        self.max_rows = max_rows  # longer sequences' chunks go to SDPA; None: every row takes the kernel

    def _kernels(self, meta: AttentionMetadata, dtype: torch.dtype) -> Any:
        if not self.rowwise or meta.positions.device.type != "cpu" or not kernel_dtype_ok(dtype):
            return None
        return rowwise_kernels()

    def plan(self, meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> None:
        if "torch" in meta.backend_state:  # target and draft share one plan
            return
        if (mod := self._kernels(meta, dtype)) is not None:
            meta.backend_state["torch"] = (mod, self._plan_rows(meta))
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
        meta.backend_state["torch"] = _TorchPlan(pages, kv_width, None, self._per_seq(meta))

    @staticmethod
    def _chunk_mask(meta: AttentionMetadata, s: int, ql: int, kv: int) -> tuple[torch.Tensor | None, bool]:
        device = meta.positions.device
        custom = meta.custom_masks[s] if meta.custom_masks is not None else None
        if custom is not None:
            return custom.to(device), False
        if 1 < ql < kv:  # a chunk or a verify block over a cache: bottom-right causal
            qpos = torch.arange(ql, device=device).unsqueeze(1) + (kv - ql)
            return torch.arange(kv, device=device).unsqueeze(0) <= qpos, False
        return None, ql == kv and ql > 1

    def _per_seq(self, meta: AttentionMetadata) -> list[tuple[int, int, int, torch.Tensor | None, bool]]:
        out, row = [], 0
        for s, (ql, kv) in enumerate(zip(meta.q_lens_cpu, meta.kv_lens_cpu)):
            out.append((row, ql, kv, *self._chunk_mask(meta, s, ql, kv)))
            row += ql
        return out

    def _plan_rows(self, meta: AttentionMetadata) -> _RowPlan:
        rows, seq, lens, extras, per_seq, row = [], [], [], [], [], 0
        for s, (ql, kv) in enumerate(zip(meta.q_lens_cpu, meta.kv_lens_cpu)):
            custom = meta.custom_masks[s] if meta.custom_masks is not None else None
            if custom is None and self.max_rows is not None and ql > self.max_rows:
                per_seq.append((s, row, ql, kv, *self._chunk_mask(meta, s, ql, kv)))
            else:
                if custom is not None:
                    lead, ex = mask_key_sets(custom)
                else:
                    lead, ex = [kv - ql + i + 1 for i in range(ql)], [[]] * ql
                rows.extend(range(row, row + ql))
                seq.extend([s] * ql)
                lens.extend(lead)
                extras.extend(ex)
            row += ql
        width = max([1] + [len(e) for e in extras])
        extra = torch.zeros(len(extras), width, dtype=torch.int32)
        for r, e in enumerate(extras):
            if e:
                extra[r, : len(e)] = torch.tensor(e, dtype=torch.int32)
        i32 = dict(dtype=torch.int32)
        return _RowPlan(
            None if len(rows) == row else torch.tensor(rows, dtype=torch.long), torch.tensor(seq, **i32),
            torch.tensor(lens, **i32), extra, torch.tensor([len(e) for e in extras], **i32),
            meta.page_table.to(torch.int32).contiguous(), per_seq,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPages,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kc, vc = cache  # (P, page, Hkv, Dh)
        hkv, dh = kc.shape[2], kc.shape[3]
        kc.view(-1, hkv, dh).index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.view(-1, hkv, dh).index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        state = meta.backend_state["torch"]
        if isinstance(state, tuple):
            return self._forward_rows(*state, q, kc, vc, meta, scale)
        plan: _TorchPlan = state
        b = plan.pages.shape[0]
        if plan.per_seq is not None:  # each sequence's keys gathered alone: never padded to the batch's longest
            outs = []
            for s, (row, ql, kv, mask, causal) in enumerate(plan.per_seq):
                pages = plan.pages[s, : -(-kv // kc.shape[1])]
                keys, values = (c[pages].view(-1, hkv, dh)[:kv] for c in (kc, vc))
                outs.append(_sdpa(q[row:row + ql], keys, values, mask, causal, scale))
            return torch.cat(outs) if len(outs) > 1 else outs[0]
        keys = kc[plan.pages].view(b, -1, hkv, dh)[:, : plan.kv_width]  # (B, L, Hkv, Dh)
        values = vc[plan.pages].view(b, -1, hkv, dh)[:, : plan.kv_width]
        if keys.dtype != torch.float32 and (b > 1 or plan.kv_width > 128):
            return _decode_attention(q, keys, values, plan.decode_mask, scale)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=plan.decode_mask,
            scale=scale, enable_gqa=q.shape[1] != hkv,
        )  # (B, Hq, 1, Dh)
        return out.squeeze(2)

    @staticmethod
    def _forward_rows(mod: Any, plan: _RowPlan, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if plan.rows is None:
            return mod.paged_attention_rows(q, kc, vc, plan.table, plan.seq, plan.lens, plan.extra,
                                            plan.extra_lens, scale)
        out = torch.empty_like(q)
        if plan.rows.numel():
            out[plan.rows] = mod.paged_attention_rows(q[plan.rows], kc, vc, plan.table, plan.seq, plan.lens,
                                                      plan.extra, plan.extra_lens, scale)
        hkv, dh, ps = kc.shape[2], kc.shape[3], kc.shape[1]
        for s, row, ql, kv, mask, causal in plan.per_seq:
            pages = plan.table[s, : -(-kv // ps)].long()
            keys = kc[pages].view(-1, hkv, dh)[:kv]
            values = vc[pages].view(-1, hkv, dh)[:kv]
            out[row:row + ql] = _sdpa(q[row:row + ql], keys, values, mask, causal, scale)
        return out


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float) -> torch.Tensor:
    """One sequence: q (q_len, Hq, Dh), keys/values (kv_len, Hkv, Dh) -> (q_len, Hq, Dh)."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != keys.shape[1],
    )  # (1, Hq, q_len, Dh)
    return o[0].transpose(0, 1)


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

    def __init__(self, device: torch.device, workspace_mb: int = FLASHINFER_WORKSPACE_MB) -> None:
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


BACKENDS = ("auto", "torch", "flashinfer")
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's paged prefill / decode kernels are built for


def flashinfer_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_refusal(model: Any) -> str | None:
    """Why FlashInfer's paged attention cannot run `model`'s attention (its cache layout), or None."""
    if getattr(model, "cache_shared", False):
        # DeepSeek's MLA in the absorbed form: one latent row of kv_lora_rank + rope dims is both key and
        # value. FlashInfer's paged MHA kernels reject that width; its MLA wrapper is not wired in here.
        return (f"its attention is MLA over a {model.cache_head_dim}-wide latent cache (keys = values), which "
                "FlashInfer's paged attention kernels do not take")
    dim = getattr(model, "cache_head_dim", None)
    if dim is not None and dim not in FLASHINFER_HEAD_DIMS:
        return f"its head_dim {dim} is not one FlashInfer's paged kernels are built for {FLASHINFER_HEAD_DIMS}"
    return None


def choose_backend(name: str, device: torch.device, model: Any = None) -> str:
    """The one rule by which eval, generate, precompute, regeneration and training validation choose the
    attention backend (`engine.backend` in a recipe, --backend on the command line): `auto` is FlashInfer
    on CUDA where it is installed and takes the model's attention shape, torch otherwise (always on CPU);
    an explicit choice the device or the model cannot run is refused, saying why."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {str(name)[:20]!r}; choose {', '.join(BACKENDS)}")
    why = flashinfer_refusal(model) if model is not None else None
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and flashinfer_installed() and why is None else "torch"
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer backend needs a CUDA device; use engine.backend torch (--backend "
                             "torch) on CPU")
        if why:
            raise ValueError(f"the flashinfer backend cannot run this target: {why}; use engine.backend torch (or "
                             "auto, which chooses torch for it)")
    return name


def check_backend(name: str, device: torch.device, model: Any) -> str:
    """choose_backend as a verb calls it before its long work (a run that would only fail at its first
    validation, hours in, or while every other rank waits in a barrier): a refusal names the recipe key."""
    from headstart.errors import ConfigError

    try:
        return choose_backend(name, device, model)
    except ValueError as e:
        raise ConfigError(f"engine.backend {str(name)[:20]}: {e}") from None


def make_backend(name: str, device: torch.device, cpu_kernels: bool = True, max_rows: int | None = MAX_ROWS,
                 model: Any = None) -> TorchAttention | FlashInferAttention:
    """The backend `choose_backend` picks for `model` on `device`; on CPU the torch backend uses the
    row-invariant kernels unless cpu_kernels=False."""
    name = choose_backend(name, device, model)
    if name == "torch":
        return TorchAttention(rowwise=cpu_kernels and device.type == "cpu", max_rows=max_rows)
    try:
        return FlashInferAttention(device)
    except ImportError:
        raise ValueError("the flashinfer backend needs `pip install -e '.[cuda]'` (flashinfer-python)") from None
