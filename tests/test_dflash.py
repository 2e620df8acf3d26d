"""DFlash heads (block-parallel drafting): the training forward's block logits equal the engine's draft
logits for the same context; the block objective's anchors, targets and weights; checkpoints; config
errors. Lossless greedy / sampled speculation with dflash heads is in test_spec.py with every proposer."""

import math

import pytest
import torch
from test_spec import _prompts
from tiny_models import make_hf_model

from headstart.errors import ConfigError
from headstart.heads import HeadConfig, PackedBatch, build_head, load_head, save_head
from headstart.heads.dflash import AnchoredBlocks, choose_anchors
from headstart.inference import Engine, SamplingParams
from headstart.inference.speculation import SpecConfig
from headstart.models.llama import load_llama
from headstart.recipe_io import recipe_from_dict
from headstart.train.module import HeadModule, target_forward


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash-target")
    make_hf_model("llama", d, seed=4)
    return load_llama(d, "fp32")


def _head(target, bs=4, layers=2, vocab=None, seed=0):
    torch.manual_seed(seed)
    head = build_head(HeadConfig(head_type="dflash", aux_layer_ids=[0, 1, 2], num_layers=layers, block_size=bs,
                                 draft_vocab_size=vocab), target)
    with torch.no_grad():  # away from the init's identities, so every weight matters
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head.requires_grad_(False)


def _recording_engine(target, head, k):
    """An engine speculating with `head` at k whose proposer records, per step and sequence, the tokens
    (t_n pending) and the draft logits of slots 1..k."""
    eng = Engine(target, page_size=4, spec=SpecConfig(method="block", k=k, head=head))
    seen, logits_of = [], []
    propose, logits = eng.proposer.propose, eng.proposer.runner.logits

    def recording(seqs, kk):
        seen.extend((s.id, list(s.token_ids)) for s in seqs)
        return propose(seqs, kk)

    def record_logits(h, rows=None):
        out = logits(h, rows)  # (B * k, V): slots 1..k of each block
        logits_of.extend(out.view(-1, k, out.shape[-1]))
        return out

    eng.proposer.propose = recording
    eng.proposer.runner.logits = record_logits
    return eng, seen, logits_of


def _block_logits(target, head, tokens, anchor, size):
    """The training forward's logits (size, V) of a block of `size` slots anchored at `anchor`."""
    # The block needs size - 1 positions after the anchor; they are masked, so any token does.
    padded = tokens + [5] * (size - 1)
    batch = target_forward(target, PackedBatch(torch.tensor(padded), [len(padded)], None, None, None), [0, 1, 2])
    with torch.no_grad():
        return head.compute_logits(head.train_blocks(batch, AnchoredBlocks(torch.tensor([anchor]),
                                                                          torch.tensor([0]), size)))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_engine_block_logits_equal_the_training_forward(target, k):
    """At every k <= block_size - 1, each step's draft logits (slots 1..k of the block at the pending
    token) equal slots 1..k of the training forward's whole block (block_size slots) anchored at the
    same position over the same tokens: context keys, RoPE positions, the mask token and the
    non-causal block must all match, and the engine must run the trained block however few it drafts."""
    head = _head(target)
    eng, seen, logits_of = _recording_engine(target, head, k)
    eng.generate(_prompts(3, seed=9), SamplingParams(max_tokens=14, ignore_eos=True))
    assert len(seen) == len(logits_of) >= 6
    for (_, tokens), got in zip(seen, logits_of):
        want = _block_logits(target, head, tokens, len(tokens) - 1, head.block_size)[1:k + 1]  # t_n: the anchor
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 2])
def test_the_whole_block_drafts_at_least_as_well_as_a_shorter_one(target, k):
    """At k < block_size - 1 the fitted head's engine tau (its trained block of 4 slots) equals or beats
    the tau of a block cut to k + 1 slots, the shape the engine used to run: that one is computed
    through the head's training forward at every step the engine took, and both are scored against
    the target's greedy continuation (which reproduces the engine's own tau for the whole block)."""
    from test_spec import fitted_dflash

    head = fitted_dflash(target)
    prompts = _prompts(4, seed=0)
    ref = Engine(target, page_size=4).generate(prompts, SamplingParams(max_tokens=24 + k, ignore_eos=True))
    eng, seen, logits_of = _recording_engine(target, head, k)
    outs = eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    greedy = {o.id: p + r.token_ids for p, o, r in zip(prompts, outs, ref)}
    whole = short = 0
    for (seq_id, tokens), got in zip(seen, logits_of):
        truth = greedy[seq_id][len(tokens):len(tokens) + k]  # t_{n+1} .. t_{n+k}
        cut = _block_logits(target, head, tokens, len(tokens) - 1, k + 1)[1:]
        drafts = [head.to_target_ids(x.argmax(-1)).tolist() for x in (got, cut)]
        runs = [next((i for i, (d, t) in enumerate(zip(ds, truth)) if d != t), k) for ds in drafts]
        whole, short = whole + runs[0], short + runs[1]
    assert 1 + whole / len(seen) == pytest.approx(eng.spec_metrics.summary()["tau"])  # the engine's own tau
    assert whole >= short, (whole, short, len(seen))


def test_the_step_reserves_the_whole_block_for_a_head_given_as_a_path(target, tmp_path):
    """The block's slots past k + 1 are reserved too (SpecConfig.lookahead is the block size), also
    when the head comes as a checkpoint directory the engine loads; decoding stays the target's,
    with preemptions (the extra slots come from the same pages) and stop tokens."""
    head = _head(target)
    save_head(head, tmp_path / "h")
    assert SpecConfig(method="block", k=1, head=head).lookahead == 4
    prompts = _prompts(12, seed=3)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[7, 11]) for _ in prompts]
    ref = Engine(target, page_size=2).generate(prompts, params)
    eng = Engine(target, page_size=2, num_pages=40, max_batch_size=12,
                 spec=SpecConfig(method="block", k=1, head=str(tmp_path / "h")))
    assert eng.spec.lookahead == 4
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in ref]
    assert eng.spec_metrics.steps > 0 and eng.stats.preemptions > 0
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_block_queries_see_no_later_context(target):
    """A block at anchor a reads the context before a only: changing tokens at or after a (other
    than the anchor itself) leaves its logits unchanged, changing one before a does not."""
    head = _head(target)
    ids = torch.tensor(_prompts(1, seed=3)[0] + list(range(40, 52)))
    a = 8

    def block_logits(x):
        batch = target_forward(target, PackedBatch(x, [x.numel()], None, None, None), [0, 1, 2])
        blocks = AnchoredBlocks(torch.tensor([a]), torch.tensor([0]), 4)
        with torch.no_grad():
            return head.compute_logits(head.train_blocks(batch, blocks))

    base = block_logits(ids)
    later = ids.clone()
    later[a + 1:] = 7
    torch.testing.assert_close(block_logits(later), base)
    earlier = ids.clone()
    earlier[a - 2] = (int(ids[a - 2]) + 1) % 320
    assert not torch.allclose(block_logits(earlier), base)


def test_packed_sequences_train_as_each_sequence_alone(target):
    """train_blocks runs every sequence's blocks in one attention call per layer (padded, one shared mask):
    each block's states equal those of its sequence run alone, whatever sits beside it (a sequence
    without a block in between; blocks of unequal counts), forward and backward."""
    head = _head(target).requires_grad_(True)
    seqs = [list(range(10, 27)), list(range(60, 66)), list(range(90, 121))]  # 17, 6 (no block), 31 tokens
    anchors = {0: [2, 9], 2: [0, 5, 17, 26]}

    def run(batch_seqs, picks):
        flat = torch.tensor([t for x in batch_seqs for t in x])
        batch = target_forward(target, PackedBatch(flat, [len(x) for x in batch_seqs], None, None, None), [0, 1, 2])
        starts = [sum(len(x) for x in batch_seqs[:i]) for i in range(len(batch_seqs))]
        rows = [(starts[s] + a, s) for s, lst in picks for a in lst]
        blocks = AnchoredBlocks(torch.tensor([r for r, _ in rows]), torch.tensor([s for _, s in rows]), 4)
        return head.train_blocks(batch, blocks)

    together = run(seqs, [(0, anchors[0]), (2, anchors[2])])
    alone = torch.cat([run([seqs[0]], [(0, anchors[0])]), run([seqs[2]], [(0, anchors[2])])])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    grads = []
    for out in (together, alone):
        head.zero_grad(set_to_none=True)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in head.parameters() if p.grad is not None])
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    head.requires_grad_(False)


def test_anchors_are_supervised_rows_with_a_whole_block_in_their_sequence():
    ids = torch.arange(30)
    mask = torch.tensor([0] * 5 + [1] * 7 + [0] * 3 + [1] * 15)  # sequences of 12, 3 and 15 rows
    batch = PackedBatch(ids, [12, 3, 15], None, None, mask)
    g = torch.Generator().manual_seed(0)
    blocks = choose_anchors(batch, 4, 100, g)
    starts = [0, 12, 15]
    for row, s in zip(blocks.anchors.tolist(), blocks.seq_of.tolist()):
        assert mask[row] == 1 and row + 4 <= starts[s] + [12, 3, 15][s] and row >= starts[s]
    assert blocks.anchors.numel() == 4 + 12  # rows 5..8 of sequence 0, 15..26 of sequence 2; none in the 3-row one
    assert torch.equal(blocks.anchors, blocks.anchors.sort().values)
    few = choose_anchors(batch, 4, 5, torch.Generator().manual_seed(1))
    assert few.anchors.numel() == 5 and set(few.anchors.tolist()) <= set(blocks.anchors.tolist())
    held = [choose_anchors(batch, 4, 5, torch.Generator().manual_seed(s), heldout=True).anchors for s in (1, 2)]
    assert torch.equal(*held)  # held out: no draw
    assert choose_anchors(PackedBatch(ids[:3], [3], None, None, mask[:3] + 1), 4, 5, g) is None


def test_block_loss_weights_slots_as_speculators_does(target):
    """The loss is sum_i exp(-(i-1)/gamma) KL_i / (supervised slots): recomputed here by hand from
    the head's logits and the target's distributions at a + i - 1, with the anchors the module draws."""
    from headstart.heads.dflash import choose_anchors as choose

    head = _head(target, bs=4, layers=1)
    recipe = recipe_from_dict({"head": {"type": "dflash", "block_size": 4, "max_anchors": 12},
                               "train": {"block_decay_gamma": 2.0}})
    module = HeadModule(recipe, target, head)
    seqs = _prompts(3, seed=4)
    ids = torch.tensor([t for s in seqs for t in s])
    mask = torch.ones(ids.numel())
    mask[:4] = 0
    mask[len(seqs[0]) + 3:len(seqs[0]) + 6] = 0  # a gap inside a sequence: blocks straddle unsupervised slots
    batch = target_forward(target, PackedBatch(ids, [len(s) for s in seqs], None, None, mask), [0, 1, 2])
    with torch.no_grad():
        loss, stats = module.losses(batch)
        again, _ = module.losses(batch)
        module.consumed = 1  # the next micro-batch draws other anchors
        other, _ = module.losses(batch)
        module.consumed = 0
    assert float(again) == float(loss) and float(other) != float(loss)
    g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + module.consumed)
    blocks = choose(batch, 4, 12, g)
    with torch.no_grad():
        q = torch.log_softmax(head.compute_logits(head.train_blocks(batch, blocks)), -1)
        rows = blocks.rows
        p = torch.log_softmax(target.compute_logits(batch.hidden[rows - 1]).float(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    slot = torch.arange(rows.numel()) % 4
    sup = (mask[rows] > 0) & (slot > 0)
    weights = torch.exp(-(slot - 1).clamp(min=0) / 2.0)
    want = (kl * weights * sup).sum() / sup.sum()
    assert float(loss) == pytest.approx(float(want), rel=1e-4)
    assert stats["rows"] == [int((sup & (slot == i)).sum()) for i in (1, 2, 3)]
    assert math.isfinite(float(loss)) and sum(stats["rows"]) > 0


def test_a_trained_dflash_head_accepts_in_the_engine(target):
    """Fitted for a few seconds to the target's greedy continuations, the block drafter accepts most
    drafts, greedy and with sampled drafts (the full-q rule), and stays lossless."""
    from test_spec import fitted_dflash

    head = fitted_dflash(target)
    prompts = _prompts(4, seed=0)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = Engine(target, page_size=4).generate(prompts, greedy)
    eng = Engine(target, page_size=4, spec=SpecConfig(method="block", k=3, head=head))
    assert [o.token_ids for o in eng.generate(prompts, greedy)] == [o.token_ids for o in ref]
    s = eng.spec_metrics.summary()
    assert s["tau"] > 2.0, s
    sampled = [SamplingParams(max_tokens=24, temperature=0.5, seed=i, ignore_eos=True) for i in range(4)]
    eng = Engine(target, page_size=4, spec=SpecConfig(method="block", k=3, head=head, draft_sampling=True))
    eng.generate(prompts, sampled)
    assert eng.spec_metrics.summary()["alpha"] > 0.05


def test_save_and_load_round_trip(target, tmp_path):
    head = _head(target, vocab=64)
    save_head(head, tmp_path / "h")
    back = load_head(tmp_path / "h", target)
    assert back.config.block_size == 4 and back.config.mask_token_id == head.config.mask_token_id
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


def test_config_errors(target):
    with pytest.raises(ValueError, match="block_size must be in 2..32"):
        HeadConfig(head_type="dflash", block_size=1)
    with pytest.raises(ValueError, match="apply to dflash heads"):
        HeadConfig(head_type="mtp", block_size=4)
    with pytest.raises(ConfigError, match="head.k"):
        recipe_from_dict({"head": {"type": "dflash", "block_size": 4, "k": 4}})
    with pytest.raises(ConfigError, match="head.block_size"):
        recipe_from_dict({"head": {"type": "eagle3", "block_size": 4}})
    with pytest.raises(Exception, match="mask_token_id=999"):
        build_head(HeadConfig(head_type="dflash", mask_token_id=999), target)
    head = _head(target)
    with pytest.raises(ValueError, match="exceeds the drafts a dflash block of 4 positions holds"):
        Engine(target, spec=SpecConfig(method="block", k=4, head=head))
    with pytest.raises(ValueError, match="cannot use a 'dflash' head"):
        Engine(target, spec=SpecConfig(method="chain", head=head))
    cfg = build_head(HeadConfig(head_type="dflash"), target).config
    assert cfg.block_size == 8 and cfg.aux_layer_ids == [0, 1]  # a 2-layer target: the defaults clipped, distinct


def test_sampled_drafts_carry_each_slots_own_q(target):
    """With sampled drafts, q[j] of a proposal is slot j's processed distribution (placed on the target
    vocabulary), and d_j is a token q[j] gives mass: the full-q rule then compares p with the q d_j was
    drawn from."""
    from headstart.inference.proposers import spread_to_target
    from headstart.inference.sampler import processed_probs

    head = _head(target, vocab=64)
    from headstart.heads import build_vocab_maps

    head.set_vocab_maps(*build_vocab_maps(torch.rand(320, generator=torch.Generator().manual_seed(2)), 64))
    eng = Engine(target, page_size=4, spec=SpecConfig(method="block", k=3, head=head, draft_sampling=True))
    got, logits_of = [], []
    propose, logits = eng.proposer.propose, eng.proposer.runner.logits

    def recording(seqs, kk):
        prop = propose(seqs, kk)
        got.append((seqs, prop))
        return prop

    def record_logits(h, rows=None):
        out = logits(h, rows)
        logits_of.append(out.view(-1, 3, out.shape[-1]))
        return out

    eng.proposer.propose, eng.proposer.runner.logits = recording, record_logits
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True) for i in range(2)]
    eng.generate(_prompts(2, seed=11), params)
    assert len(got) >= 3
    for (seqs, prop), lg in zip(got, logits_of):
        for b, s in enumerate(seqs):
            for j in range(3):
                want = spread_to_target(processed_probs(lg[b, j:j + 1], [s.params])[0], 320, head.to_target_ids)
                torch.testing.assert_close(prop.q[b][j], want)
                assert float(prop.q[b][j][prop.drafts[b][j]]) > 0


def _exported(target, tmp_path, **edits):
    import json

    from headstart.export import export_head

    head = _head(target, vocab=64)
    from headstart.heads import build_vocab_maps

    head.set_vocab_maps(*build_vocab_maps(torch.rand(320, generator=torch.Generator().manual_seed(2)), 64))
    out = tmp_path / "exp"
    export_head(head, target, "vllm", out)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in edits.items():
        if key.startswith("layer."):
            cfg["transformer_layer_config"][key[6:]] = value
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(("edits", "reason"), [
    ({"sample_from_anchor": True}, "sample_from_anchor is true"),
    ({"layer.layer_types": ["sliding_attention", "full_attention"]}, "sliding-window layers"),
    ({"layer.attention_bias": True}, "attention_bias is true"),
    ({"mask_token_id": "m"}, "mask_token_id must be a token id"),
    ({"mask_token_id": 7}, "mask_token_id=7 but the headstart record says"),
    ({"block_size": 6}, "block_size=6 but the headstart record says"),
])
def test_dflash_import_refusals(target, tmp_path, edits, reason):
    from headstart.errors import AssetError
    from headstart.export import import_head

    out = _exported(target, tmp_path, **edits)
    with pytest.raises(AssetError, match=reason):
        import_head(out, "vllm", target, tmp_path / "back")


def test_dflash_import_refuses_a_trained_lm_head_and_export_duplicate_aux_ids(target, tmp_path):
    from safetensors.torch import load_file, save_file

    from headstart.errors import AssetError
    from headstart.export import import_head

    out = _exported(target, tmp_path)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.5
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AssetError, match="not the target's rows"):
        import_head(out, "vllm", target, tmp_path / "back")
    with pytest.raises(ValueError, match="aux_layer_ids must be distinct"):
        HeadConfig(head_type="dflash", aux_layer_ids=[1, 1, 0], block_size=4)
    with pytest.raises(ValueError, match="aux_layer_ids is empty"):
        HeadConfig(head_type="dflash", aux_layer_ids=[])
    with pytest.raises(ValueError, match="block_size must be an integer"):
        HeadConfig(head_type="dflash", block_size=4.0)
    with pytest.raises(ConfigError, match="head.max_anchors"):
        recipe_from_dict({"head": {"type": "mtp", "max_anchors": 8}})


def test_an_sglang_dflash_config_without_its_section_or_with_two_block_sizes_is_named(target, tmp_path):
    import json

    from headstart.errors import AssetError
    from headstart.export import export_head, import_head

    torch.manual_seed(0)
    head = build_head(HeadConfig(head_type="dflash", aux_layer_ids=[1, 2], num_layers=2, block_size=4), target)
    export_head(head, target, "sglang", tmp_path / "exp")
    path = tmp_path / "exp" / "config.json"
    bare = {k: v for k, v in json.loads(path.read_text()).items() if k != "headstart"}
    for edited, reason in (({k: v for k, v in bare.items() if k != "dflash_config"}, "no dflash_config object"),
                           ({**bare, "block_size": 6}, "block_size 6 and dflash_config.block_size 4 disagree")):
        path.write_text(json.dumps(edited))
        with pytest.raises(AssetError, match=reason):
            import_head(tmp_path / "exp", "sglang", target, tmp_path / "back")
    path.write_text(json.dumps(bare))
    assert import_head(tmp_path / "exp", "sglang", target, tmp_path / "back").config.block_size == 4
