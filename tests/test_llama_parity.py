"""Our Llama-family forward vs HF transformers on tiny random configs (fp32): prefill over a batch of
mixed lengths, chunked prefill, and step-by-step decode through the paged KV cache."""

import pytest
import torch
from tiny_models import FAMILIES, make_hf_model

from headstart.inference.backends import TorchAttention
from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator
from headstart.inference.runner import build_metadata
from headstart.inference.sampler import SamplingParams
from headstart.inference.scheduler import Scheduler, Sequence
from headstart.models.llama import load_llama


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, d)
    return hf, load_llama(d, dtype="fp32")


def _runner(model, page_size=4, num_pages=64, max_tokens=4096):
    cfg = model.config
    alloc = PageAllocator(num_pages, page_size)
    cache = KVCache(KVCacheSpec(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                                head_dim=cfg.head_dim, dtype=model.dtype), num_pages, page_size, "cpu")
    sched = Scheduler(alloc, max_batch_size=8, max_batched_tokens=max_tokens, device=torch.device("cpu"))
    backend = TorchAttention()

    def step():
        batch = sched.schedule()
        batch.meta = build_metadata(alloc, batch.items, torch.device("cpu"))  # kept for the assertions below
        h, aux = model(batch.input_ids, batch.meta, cache.layers, backend, capture=(0, 1, 2))
        for s, n in zip(batch.seqs, batch.num_tokens):
            s.num_cached += n
        return batch, h, aux

    return sched, step


def _prompts(vocab, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def test_prefill_mixed_batch_matches_hf(pair):
    hf, ours = pair
    prompts = _prompts(hf.config.vocab_size, [5, 17, 1, 9])
    sched, step = _runner(ours)
    for i, p in enumerate(prompts):
        sched.add(Sequence(f"s{i}", p, SamplingParams()))
    batch, h, aux = step()
    assert batch.meta.q_lens_cpu == [5, 17, 1, 9]
    logits = ours.compute_logits(h)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            ref = hf(torch.tensor([p]), output_hidden_states=True)
            lo, hi = batch.meta.qo_indptr[b].item(), batch.meta.qo_indptr[b + 1].item()
            torch.testing.assert_close(logits[lo:hi], ref.logits[0], rtol=1e-4, atol=1e-4)
            # Aux layer j = HF hidden_states[j] (entering layer j); the last one is pre-norm.
            for j in (0, 1):
                torch.testing.assert_close(aux[j][lo:hi], ref.hidden_states[j][0], rtol=1e-4, atol=1e-4)
            assert not torch.allclose(h[lo:hi], ref.hidden_states[-1][0])  # HF's last one is post-norm
            torch.testing.assert_close(ours.model.norm(h[lo:hi]), ref.hidden_states[-1][0], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_and_decode_match_hf(pair):
    hf, ours = pair
    prompts = _prompts(hf.config.vocab_size, [23, 7], seed=2)
    sched, step = _runner(ours, page_size=3, max_tokens=8)  # 8-token budget: the 23-token prompt is chunked
    seqs = [Sequence(f"s{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    last_logits = {}
    while any(s.num_cached < s.total_len for s in seqs):
        batch, h, _ = step()
        if batch.samplers:
            lg = ours.compute_logits(h, torch.tensor(batch.sample_rows))
            for s, row in zip(batch.samplers, lg):
                last_logits[s.id] = row
    for _ in range(6):  # decode: feed HF's greedy token, compare the next logits
        with torch.no_grad():
            refs = [hf(torch.tensor([s.token_ids])).logits[0, -1] for s in seqs]
        for s, ref in zip(seqs, refs):
            torch.testing.assert_close(last_logits[s.id], ref, rtol=1e-4, atol=1e-4)
            s.output_ids.append(int(ref.argmax()))
        batch, h, _ = step()
        assert batch.meta.q_lens_cpu == [1, 1]
        lg = ours.compute_logits(h, torch.tensor(batch.sample_rows))
        last_logits = {s.id: row for s, row in zip(batch.samplers, lg)}


def test_bf16_is_close_to_hf_bf16(pair):
    hf, ours = pair
    try:
        hf16, ours16 = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
        assert ours16.model.rotary.cos.dtype == torch.float32  # the RoPE tables stay fp32
        prompt = _prompts(hf.config.vocab_size, [12], seed=3)[0]
        sched, step = _runner(ours16)
        sched.add(Sequence("s", prompt, SamplingParams()))
        _, h, _ = step()
        with torch.no_grad():
            ref = hf16(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(ours16.compute_logits(h), ref, rtol=0.05, atol=0.05)
    finally:
        hf.float()
        ours.float()
