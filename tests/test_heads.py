"""Every head family on a tiny random target: training forward == serving forward through the paged
KV cache, save/load round trips, init from the target, vocabulary maps, refusal of a wrong target."""

import dataclasses

import pytest
import torch
from tiny_models import make_hf_model

from headstart.errors import AssetError
from headstart.heads import (
    HeadConfig,
    PackedBatch,
    build_head,
    build_vocab_maps,
    load_head,
    save_head,
    shift_for_head,
)
from headstart.heads.config import EAGLE_FLAGS, default_aux_layers
from headstart.inference.backends import TorchAttention
from headstart.inference.kv_cache import KVCache, KVCacheSpec, PageAllocator
from headstart.inference.runner import build_metadata
from headstart.inference.sampler import SamplingParams
from headstart.inference.scheduler import Scheduler, Sequence
from headstart.models.llama import load_llama

CHAIN = ["mtp", "eagle1", "deepseek_mtp", "eagle3", "draft_lm"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    make_hf_model("llama", d, seed=11)
    return load_llama(d, "fp32")


def _target_states(target, seqs):
    """Run the target over packed sequences: (input_ids, hidden (N, d), aux (N, 3, d))."""
    from headstart.nn.attention import PackedCausalAttention, packed_metadata

    ids = torch.tensor([t for s in seqs for t in s])
    meta = packed_metadata([len(s) for s in seqs])
    with torch.no_grad():
        h, aux = target(ids, meta, [None] * target.num_layers, PackedCausalAttention(), capture=(0, 1, 2))
    return ids, h, torch.stack([aux[0], aux[1], aux[2]], dim=1)


def _config(kind, **kw):
    if kind == "eagle3":
        kw.setdefault("aux_layer_ids", [0, 1, 2])
        kw.setdefault("draft_vocab_size", 64)
    return HeadConfig(head_type=kind, **kw)


def _batch(target):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (9, 5, 12)]
    ids, h, aux = _target_states(target, seqs)
    return PackedBatch(ids, [len(s) for s in seqs], hidden=h, aux_hidden=aux,
                       loss_mask=torch.ones(ids.numel(), dtype=torch.uint8))


def _serve_step_by_step(head, batch):
    """Feed the (shifted) rows through the engine's paged cache: a 3-token prefill step, then one row
    per decode step, several sequences per batch. Returns hidden states in row order."""
    if head.config.head_type == "draft_lm":  # a plain LM: rows are the tokens themselves
        rows_all = torch.arange(batch.input_ids.numel())
        shifted = dataclasses.replace(shift_for_head(batch.input_ids, batch.seq_lens), tokens=batch.input_ids,
                                      src_rows=rows_all, seq_lens=list(batch.seq_lens))
        feats = torch.zeros(len(rows_all), 0)
    else:
        shifted = shift_for_head(batch.input_ids, batch.seq_lens, batch.loss_mask)
        feats = head.target_features(
            batch.hidden[shifted.src_rows] if batch.hidden is not None else None,
            batch.aux_hidden[shifted.src_rows] if batch.aux_hidden is not None else None,
        )
    cfg = head.config
    alloc = PageAllocator(64, 2)
    cache = KVCache(KVCacheSpec(num_layers=head.kv_layers(), num_kv_heads=cfg.num_key_value_heads,
                                head_dim=cfg.head_dim, dtype=torch.float32), 64, 2, "cpu")
    sched = Scheduler(alloc, max_batch_size=8, max_batched_tokens=3 * len(shifted.seq_lens),
                      device=torch.device("cpu"))
    starts = [0]
    for n in shifted.seq_lens:
        starts.append(starts[-1] + n)
    seqs = []
    for s in range(len(shifted.seq_lens)):
        tokens = shifted.tokens[starts[s]:starts[s + 1]].tolist()
        seq = Sequence(f"s{s}", tokens[:3], SamplingParams())  # first step: up to 3 rows at once
        seq.pending = tokens[3:]
        seqs.append(seq)
        sched.add(seq)
    out = torch.zeros(len(shifted.tokens), cfg.hidden_size)
    backend = TorchAttention()
    while any(s.pending or s.num_cached < s.total_len for s in seqs):
        batch_ = sched.schedule()
        rows = []
        for seq, n in zip(batch_.seqs, batch_.num_tokens):
            s = int(seq.id[1:])
            rows.extend(range(starts[s] + seq.num_cached, starts[s] + seq.num_cached + n))
        rows_t = torch.tensor(rows)
        with torch.no_grad():
            meta = build_metadata(alloc, batch_.items, torch.device("cpu"))
            h, _ = head.draft_step(batch_.input_ids, feats[rows_t], meta, cache.layers, backend)
        out[rows_t] = h
        for seq, n in zip(batch_.seqs, batch_.num_tokens):
            seq.num_cached += n
            if seq.pending:
                seq.output_ids.append(seq.pending.pop(0))
    return out


@pytest.mark.parametrize("kind", CHAIN + ["mtp-postnorm", "deepseek_mtp-postnorm"])
def test_train_forward_equals_serving_through_the_kv_cache(target, kind):
    base, _, post = kind.partition("-")
    head = build_head(_config(base, postnorm_features=True) if post else _config(base), target)
    batch = _batch(target)
    if post:  # the head reads the target's output after its final norm, as vLLM / SGLang feed it
        with torch.no_grad():
            assert torch.equal(head.target_features(batch.hidden), target.model.norm(batch.hidden))
    with torch.no_grad():
        trained, shifted = head.train_forward(batch)
    served = _serve_step_by_step(head, batch)
    torch.testing.assert_close(served, trained, rtol=1e-4, atol=1e-4)
    assert trained.shape == (len(shifted.tokens), head.config.hidden_size)


def test_shift_by_one_worked_example():
    ids = torch.tensor([10, 11, 12, 13, 20, 21])
    s = shift_for_head(ids, [4, 2], torch.tensor([0, 1, 1, 0, 1, 1]))
    assert s.tokens.tolist() == [11, 12, 13, 21]
    assert s.src_rows.tolist() == [0, 1, 2, 4] and s.target_rows.tolist() == [1, 2, 3, 5]
    assert s.next_tokens.tolist() == [12, 13, -100, -100]
    assert s.token_mask.tolist() == [1, 0, 0, 0]  # t2 supervised, t3 not, no t4 / t2' at all
    assert s.seq_lens == [3, 1]


@pytest.mark.parametrize("kind", CHAIN + ["medusa"])
def test_save_load_bit_for_bit_and_no_target_weights(target, kind, tmp_path):
    head = build_head(_config(kind), target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    target_ids = {id(p) for p in target.parameters()}
    assert not target_ids & {id(p) for p in head.trainable_parameters()}
    assert not any(k.startswith(("target.", "model.")) for k in head.state_dict())
    batch = _batch(target)
    path = save_head(head, tmp_path / kind)
    again = load_head(path, target)
    with torch.no_grad():
        a, _ = head.train_forward(batch)
        b, _ = again.train_forward(batch)
    assert torch.equal(a, b)
    saved = set(again.state_dict())
    assert saved == set(head.state_dict())
    frozen = {tuple(t.shape) for t in (target.model.embed_tokens.weight, target.lm_head.weight,
                                      target.model.norm.weight)}
    own_vocab = {(head.config.draft_vocab_size, head.config.hidden_size)} if head.config.draft_vocab_size else set()
    # No tensor of the target's frozen shapes is saved (a draft vocabulary's own lm_head excepted).
    assert not {tuple(v.shape) for v in head.state_dict().values() if v.ndim == 2} & (frozen - own_vocab)


def test_mtp_and_eagle1_differ_only_in_norm_flags(target):
    mtp, e1 = _config("mtp"), _config("eagle1")
    diff = {f.name for f in dataclasses.fields(HeadConfig) if getattr(mtp, f.name) != getattr(e1, f.name)}
    assert diff == {"head_type"} | set(EAGLE_FLAGS["mtp"])
    # eagle1 with mtp's flags is the same module, weight for weight.
    flipped = build_head(dataclasses.replace(e1, **EAGLE_FLAGS["mtp"]), target)
    reference = build_head(mtp, target)
    shapes = {k: v.shape for k, v in flipped.state_dict().items()}
    assert shapes == {k: v.shape for k, v in reference.state_dict().items()}
    plain = build_head(e1, target)
    assert "norm.weight" not in plain.state_dict() and "fc.bias" in plain.state_dict()
    assert "layers.0.input_layernorm.weight" not in plain.state_dict()
    assert "layers.0.input_layernorm.weight" in reference.state_dict()


def test_init_from_target(target):
    head = build_head(_config("mtp"), target)
    last = target.model.layers[-1]
    assert torch.equal(head.layers[0].mlp.gate_up_proj.weight, last.mlp.gate_up_proj.weight)
    assert torch.equal(head.norm.weight, target.model.norm.weight)
    ds = build_head(_config("deepseek_mtp"), target)
    assert torch.equal(ds.shared_head.norm.weight, target.model.norm.weight)


def test_draft_lm_from_all_target_layers_is_the_target(target):
    head = build_head(_config("draft_lm", num_layers=2), target)
    batch = _batch(target)
    with torch.no_grad():
        h, _ = head.train_forward(batch)
        torch.testing.assert_close(head.compute_logits(h), target.compute_logits(batch.hidden), rtol=1e-4, atol=1e-4)


def test_medusa_starts_as_the_target_prediction(target):
    head = build_head(_config("medusa", medusa_num_heads=3), target)
    batch = _batch(target)
    with torch.no_grad():
        z, _ = head.train_forward(batch)
        logits = head.compute_logits(z)  # (N, 3, V)
        ref = target.compute_logits(batch.hidden)
    assert logits.shape == (batch.input_ids.numel(), 3, 320)
    for j in range(3):
        torch.testing.assert_close(logits[:, j], ref, rtol=1e-4, atol=1e-4)


def test_deepseek_zeroes_the_embedding_at_position_zero(target):
    head = build_head(_config("deepseek_mtp"), target)
    batch = _batch(target)
    other = dataclasses.replace(batch, input_ids=batch.input_ids.clone())
    other.input_ids[1] = (other.input_ids[1] + 7) % 320  # t_1 feeds row 0 (position 0) only
    with torch.no_grad():
        a, _ = head.train_forward(batch)
        b, _ = head.train_forward(other)
    torch.testing.assert_close(a[0], b[0])


def test_vocab_maps():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    d2t, t2d = build_vocab_maps(counts, 4)
    ids = torch.arange(4) + d2t
    assert ids.tolist() == [0, 2, 3, 5]  # the 4 most frequent, ascending
    assert int(t2d.sum()) == 4 and t2d[ids].all()
    assert (ids < 8).all() and (d2t >= 0).all()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_maps(counts, 9)


def test_eagle3_reduced_vocab(target):
    head = build_head(_config("eagle3"), target)
    counts = torch.arange(320).float()  # higher ids more frequent
    d2t, t2d = build_vocab_maps(counts, 64)
    head.set_vocab_maps(d2t, t2d)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[256:])
    assert head.to_target_ids(torch.tensor([0, 63])).tolist() == [256, 319]
    assert head.compute_logits(torch.zeros(2, 64)).shape == (2, 64)


def test_wrong_target_is_refused(target, tmp_path):
    head = build_head(_config("eagle3"), target)
    path = save_head(head, tmp_path / "h")
    other_dir = tmp_path / "other"
    make_hf_model("llama", other_dir, vocab_size=400)
    other = load_llama(other_dir)
    with pytest.raises(AssetError, match="vocab_size=320, this target has 400"):
        load_head(path, other)
    with pytest.raises(AssetError, match=r"aux layer 5 is out of range .* 2 layers \(valid: 0..2\)"):
        build_head(_config("eagle3", aux_layer_ids=[0, 1, 5]), target)
    with pytest.raises(AssetError, match="head hidden_size=32 but the target's is 64"):
        build_head(_config("mtp", hidden_size=32), target)
    with pytest.raises(ValueError, match="unknown head type"):
        HeadConfig(head_type="hydra")


@pytest.mark.parametrize("ids", [[2, 0, 1], [1, 1, 2], [2, 1]])
def test_aux_layer_ids_must_be_distinct_and_ascending_everywhere(target, tmp_path, ids):
    """vLLM and SGLang capture the aux states in layer order whatever a config lists: a head whose fc read
    them in another order would be served a permutation of its input. Refused in the recipe (before
    anything runs), at head init, at load of an edited checkpoint and at import of a foreign export."""
    import json

    from headstart.errors import ConfigError
    from headstart.export import export_head, import_head
    from headstart.recipe_io import recipe_from_dict

    with pytest.raises(ConfigError, match="head.aux_layer_ids.*distinct and ascending"):
        recipe_from_dict({"head": {"type": "eagle3", "aux_layer_ids": ids}})
    for kind in ("eagle3", "dflash"):
        with pytest.raises(ValueError, match="aux_layer_ids must be (distinct|ascending)"):
            HeadConfig(head_type=kind, aux_layer_ids=ids)
    good = save_head(build_head(_config("eagle3", draft_vocab_size=None), target), tmp_path / "h")
    raw = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps({**raw, "aux_layer_ids": ids}))
    with pytest.raises(AssetError, match="aux_layer_ids must be"):
        load_head(good, target)
    (good / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "vllm"
    export_head(load_head(good, target), target, "vllm", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("headstart", None)  # a foreign export: the layout's own fields are all there is
    cfg["eagle_aux_hidden_state_layer_ids"] = ids + [0] * (3 - len(ids))
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssetError, match="config.json: aux_layer_ids must be"):
        import_head(out, "vllm", target, tmp_path / "back")
    assert default_aux_layers(2) == [0, 1] and default_aux_layers(4) == [1, 2] and default_aux_layers(30) == [2, 15, 27]
    with pytest.raises(ConfigError, match="head.aux_layer_ids.*is empty"):
        recipe_from_dict({"head": {"type": "eagle3", "aux_layer_ids": []}})
    # An SGLang export that does not name its layers imports with the same defaults (distinct on 2 layers).
    sg = tmp_path / "sglang"
    export_head(build_head(_config("eagle3", aux_layer_ids=[1, 2], draft_vocab_size=None, norm_before_fc=False,
                                   norm_before_residual=False), target), target, "sglang", sg)  # flags SGLang has
    cfg = json.loads((sg / "config.json").read_text())
    cfg.pop("headstart", None)
    cfg["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    (sg / "config.json").write_text(json.dumps(cfg))
    assert import_head(sg, "sglang", target, tmp_path / "sg-back").config.aux_layer_ids == default_aux_layers(2)


def test_consumes(target):
    assert build_head(_config("mtp"), target).consumes == {"last_hidden": True, "aux_layers": []}
    assert build_head(_config("eagle3"), target).consumes["aux_layers"] == [0, 1, 2]
    assert build_head(_config("draft_lm"), target).consumes == {"last_hidden": False, "aux_layers": []}


def test_every_head_type_builds_from_a_recipe_section(target):
    from headstart.config import HeadSection
    from headstart.heads import HEAD_TYPES, head_config_from_recipe

    for kind in HEAD_TYPES:
        section = HeadSection(type=kind, aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None)
        head = build_head(head_config_from_recipe(section), target)
        assert head.config.head_type == kind
    for kind in ("mtp", "deepseek_mtp"):  # the recipe's feature convention reaches the head
        section = HeadSection(type=kind, postnorm_features=True)
        head = build_head(head_config_from_recipe(section), target)
        assert head.config.postnorm_features is True
        x = torch.randn(3, target.config.hidden_size)
        with torch.no_grad():
            assert torch.equal(head.target_features(x), target.model.norm(x))
