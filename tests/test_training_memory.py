"""What one training micro-batch keeps for backward (autograd's saved tensors, counted by storage): it
grows with the micro-batch's rows, not with its sequences padded to the longest one, and `plan`'s terms
for it are at least what is measured, for every head family, on a mix of lengths that packing allows."""

import pytest
import torch
from test_train_parts import _batch

from headstart.heads import HeadConfig, build_head, head_config_from_recipe
from headstart.nn.attention import PaddedLayout
from headstart.plan import ACTIVATION_TERMS, make_plan
from headstart.recipe_io import recipe_from_dict
from headstart.train.module import HeadModule
from headstart.train.saved import SavedBytes
from headstart.train.ttt import unroll

# One long conversation packed with many short ones, and the same rows as two even sequences.
MIXED = (129,) + (5,) * 32
EVEN = (145, 144)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """{"llama", "deepseek"}: (the tiny target, its config.json as a dict)."""
    import json

    from test_deepseek import CONFIGS, _hf_model
    from tiny_models import make_hf_model

    from headstart.models import load_target

    out = {}
    d = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", d, seed=5, vocab_size=512)
    out["llama"] = d
    d = tmp_path_factory.mktemp("deepseek")
    kind, overrides = CONFIGS["v2-lite"]
    _hf_model(kind, overrides).save_pretrained(d)
    out["deepseek"] = d
    return {k: (load_target(d, "fp32"), json.loads((d / "config.json").read_text())) for k, d in out.items()}


def saved_bytes(fn, *modules):
    """Bytes of the distinct storages autograd saves while `fn` runs, parameters left out, and fn's result."""
    with SavedBytes(*modules) as kept:
        out = fn()
    return kept.bytes, out


def test_the_layout_pads_each_sequence_to_under_twice_its_length_in_few_buckets():
    lens = [1000, 3, 0, 501, 499, 7, 250, 1, 2]
    lay = PaddedLayout.of(lens, "cpu")
    assert lay.slots < 2 * sum(lens)
    assert lay.lengths == [1000, 499, 7, 3, 1]  # a new bucket below half the bucket's longest
    x = torch.arange(sum(lens), dtype=torch.float32)[:, None] * torch.ones(1, 3)
    padded = lay.pad(x)
    assert [tuple(p.shape) for p in padded] == [(2, 1000, 3), (2, 499, 3), (1, 7, 3), (2, 3, 3), (1, 1, 3)]
    assert torch.equal(lay.unpad(padded), x)
    one = PaddedLayout.of(lens, "cpu", bucketed=False)  # every sequence in order, empty ones included
    assert one.lengths == [1000] and one.slots == 9000 and torch.equal(one.unpad(one.pad(x)), x)
    assert PaddedLayout.of([0, 0], "cpu").slots == 0
    # exactly half of the bucket's longest stays in it (padded to twice its length); one row fewer does not
    assert PaddedLayout.of([4, 2], "cpu").lengths == [4] and PaddedLayout.of([4, 1], "cpu").lengths == [4, 1]
    assert PaddedLayout.of([9, 5, 4], "cpu").lengths == [9, 4]


@pytest.mark.parametrize("kind", ["mtp", "eagle3", "deepseek_mtp"])
def test_a_ttt_micro_batch_keeps_bytes_in_proportion_to_its_rows_not_its_padding(targets, kind):
    """A long sequence packed with 32 short ones keeps about what the same rows as two even sequences
    keep; padded to the longest (one batch of 33 x 128 slots), its K/V copies were ~14x larger."""
    model = targets["deepseek" if kind == "deepseek_mtp" else "llama"][0]
    head = build_head(HeadConfig(head_type=kind, **({"aux_layer_ids": [0, 1, 2]} if kind == "eagle3" else {})),
                      model)
    assert sum(MIXED) == sum(EVEN)

    def kept(lens):
        b = _batch(model, lens=lens)
        return saved_bytes(lambda: unroll(head, b, 4), head, model)[0]

    mixed, even = kept(MIXED), kept(EVEN)
    assert even > 4 * sum(EVEN) * head.config.hidden_size  # at least a d-wide fp32 row each: the count counts
    assert mixed <= 1.2 * even, (mixed, even)


FAMILIES = [("mtp", {}), ("eagle1", {}), ("eagle3", {"aux_layer_ids": [0, 1, 2], "draft_vocab_size": 96}),
            ("deepseek_mtp", {}), ("draft_lm", {"num_layers": 2}), ("medusa", {}),
            ("dflash", {"aux_layer_ids": [0, 1, 2], "num_layers": 2, "block_size": 4, "max_anchors": 16})]


@pytest.mark.parametrize(("kind", "head_kw"), FAMILIES, ids=[f[0] for f in FAMILIES])
@pytest.mark.parametrize("lens", [MIXED, EVEN], ids=["mixed", "even"])
def test_plan_counts_at_least_what_a_micro_batch_keeps(targets, kind, head_kw, lens):
    """plan's activation terms for a micro-batch of train.batch_tokens rows (the longest sequence
    data.max_length) against autograd's saved bytes for the head's losses on such a batch, fp32."""
    model, cfg = targets["deepseek" if kind == "deepseek_mtp" else "llama"]
    tr = {"ttt_steps": 3, "batch_tokens": sum(lens), "loss_chunk_tokens": 64}
    recipe = recipe_from_dict({"target": {"model": "unused", "dtype": "fp32"},
                               "head": {"type": kind, "init_from_target": False, **head_kw}, "train": tr,
                               "data": {"max_length": max(lens)}, "trainer": {"accelerator": "cpu"}})
    planned = sum(t.bytes for p in make_plan(recipe, cfg, device="CPU RAM").phases if p.name == "train"
                  for t in p.terms if t.name in ACTIVATION_TERMS)
    head = build_head(head_config_from_recipe(recipe.head), model, init_from_target=False)
    module = HeadModule(recipe, model, head)
    b = _batch(model, lens=lens)
    measured, _ = saved_bytes(lambda: module.losses(b, with_stats=False), head, model)
    assert measured <= planned, (measured, planned)
    print(f"{kind} {len(lens)} sequences: measured {measured:,} B, planned {planned:,.0f} B")


def _one_bucket(monkeypatch):
    monkeypatch.setattr(PaddedLayout, "buckets", staticmethod(lambda lens: [[i for i, n in enumerate(lens) if n > 0]]))


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "draft_lm"])
def test_several_buckets_give_what_one_padded_batch_gives(targets, kind, monkeypatch):
    """The loss and its gradients with the sequences in several length buckets (and DFlash's split by block
    rows) equal those of one padded batch of every sequence: a row routed to the wrong slot, a bucket's
    block rows paired with another bucket's context, or a mask of the wrong bucket length shows."""
    import dataclasses

    model = targets["llama"][0]
    extra = {"aux_layer_ids": [0, 1, 2]} if kind != "draft_lm" else {"num_layers": 2}
    if kind == "dflash":
        extra.update(block_size=4, max_anchors=64)
    recipe = recipe_from_dict({"head": {"type": kind, "init_from_target": False, **extra},
                               "train": {"ttt_steps": 3, "loss_chunk_tokens": 64}})
    head = build_head(head_config_from_recipe(recipe.head), model, init_from_target=False)
    b = _batch(model, lens=(40, 21, 20, 11, 9, 3, 30, 6))

    def run():
        torch.manual_seed(0)
        module = HeadModule(recipe, model, head)
        head.zero_grad(set_to_none=True)
        loss, _ = module.losses(dataclasses.replace(b), with_stats=False)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in head.trainable_parameters() if p.grad is not None]

    assert len(PaddedLayout.buckets([39, 20, 19, 10, 8, 2, 29, 5])) >= 3
    got_loss, got = run()
    with monkeypatch.context() as m:
        _one_bucket(m)
        want_loss, want = run()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert len(got) == len(want) > 0
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_the_recomputed_step_gives_autocasts_gradients():
    """_RecomputedStep under CPU bf16 autocast: the backward reruns the step in the forward's autocast state,
    so its gradients are those of plain autograd through the same step (not an fp32 rebuild's)."""
    from headstart.train.ttt import UnrolledAttention, _RecomputedStep, _step_attention

    g = torch.Generator().manual_seed(0)
    j, shape = 2, (2, 6, 4, 8)  # (B, L, H, D); 2 KV heads under 4 query heads
    q = torch.randn(*shape, generator=g)
    kvs = [torch.randn(2, 6, 2, 8, generator=g) for _ in range(2 * (j + 1))]
    mask = UnrolledAttention().mask(j, 6, torch.bfloat16, torch.device("cpu"))

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, *kvs)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(leaves[0], tuple(leaves[1:]))
        out.float().square().sum().backward()
        return [t.grad for t in leaves]

    got = grads(lambda qq, kk: _RecomputedStep.apply(qq, mask, j, 0.3, *kk))
    want = grads(lambda qq, kk: _step_attention(qq, kk, mask, j, 0.3))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
