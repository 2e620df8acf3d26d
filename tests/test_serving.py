"""Our vLLM exports load with the `speculators` package's own classes (0.9.0, in .venv-serving) and give
the same first-step logits as our heads: `eagle3` on a tiny Llama, `mtp` on a tiny Qwen3. Each side is
fed what its engine feeds: our head the target's states as our engine captures them (pre-norm, plus
aux layers), speculators' model what vLLM hands a drafter (the aux states for EAGLE-3, else the
model's output after the final norm), so a head trained on another state than vLLM feeds fails."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import make_hf_model

from headstart.export import export_head
from headstart.heads import HeadConfig, PackedBatch, build_head, build_vocab_maps
from headstart.models.llama import load_llama
from headstart.train.module import target_forward

ROOT = Path(__file__).resolve().parents[1]
SERVING_PY = ROOT / ".venv-serving" / "bin" / "python"


def _serving_ready() -> bool:
    if not SERVING_PY.exists():
        return False
    return subprocess.run([str(SERVING_PY), "-c", "import speculators.models.eagle3, speculators.models.mtp"],
                          capture_output=True).returncode == 0


pytestmark = [pytest.mark.serving,
              pytest.mark.skipif(not _serving_ready(), reason="no .venv-serving with speculators (make serving-env)")]


@pytest.mark.parametrize(("family", "kind"), [("llama", "eagle3"), ("qwen3", "mtp")])
def test_speculators_loads_our_export_with_the_same_logits(tmp_path, family, kind):
    make_hf_model(family, tmp_path / "target", seed=4)
    target = load_llama(tmp_path / "target", "fp32")
    torch.manual_seed(1)
    head = build_head(HeadConfig(head_type=kind, draft_vocab_size=64 if kind == "eagle3" else None,
                                 aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None,
                                 postnorm_features=True if kind == "mtp" else None), target)
    if kind == "eagle3":
        head.set_vocab_maps(*build_vocab_maps(torch.rand(320), 64))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export_head(head, target, "vllm", tmp_path / "export")
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(3))
    batch = target_forward(target, PackedBatch(ids, [12]), list(head.config.aux_layer_ids or []))
    with torch.no_grad():
        h, _ = head.train_forward(batch)
        expected = head.compute_logits(h)
    with torch.no_grad():  # what vLLM feeds: the aux states, or the model's output (after the final norm)
        hidden = batch.aux_hidden.reshape(12, -1) if kind == "eagle3" else target.model.norm(batch.hidden)
    save_file({"input_ids": ids, "hidden": hidden.contiguous(), "expected": expected.contiguous()},
              str(tmp_path / "case.safetensors"))
    run = subprocess.run([str(SERVING_PY), str(ROOT / "tests" / "serving_check.py"), kind, str(tmp_path / "export"),
                          str(tmp_path / "target"), str(tmp_path / "case.safetensors")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["rows"] >= 8 and result["argmax_equal"]
    assert result["max_abs_diff"] < 1e-4, result
    assert sys.executable != str(SERVING_PY)  # the check ran in the other environment


def test_speculators_computes_our_eagle31_heads_for_every_flag_combination(tmp_path):
    """Each EAGLE-3.1 flag combination speculators accepts (norm_before_fc, fc_norm, norm_before_residual,
    norm_output; the first two exclusive), exported for vLLM and run by speculators' Eagle3DraftModel:
    the first step's logits and the second TTT step's (the output fed back, as norm_output says) equal
    ours. One speculators process checks every export."""
    import itertools

    from headstart.heads.config import EAGLE31_FLAGS
    from headstart.train.ttt import unroll

    make_hf_model("llama", tmp_path / "target", seed=4)
    target = load_llama(tmp_path / "target", "fp32")
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(3))
    batch = target_forward(target, PackedBatch(ids, [12]), [0, 1, 2])
    args = []
    combos = [bits for bits in itertools.product((False, True), repeat=4) if not all(bits[:2])]
    for n, bits in enumerate(combos):
        torch.manual_seed(1)
        head = build_head(HeadConfig(head_type="eagle3", draft_vocab_size=64, aux_layer_ids=[0, 1, 2],
                                     **dict(zip(EAGLE31_FLAGS, bits))), target)
        head.set_vocab_maps(*build_vocab_maps(torch.rand(320), 64))
        with torch.no_grad():  # norms away from one: a norm applied twice, or skipped, shows
            for p in head.parameters():
                p.add_(0.1 * torch.randn_like(p))
            outs, _, _ = unroll(head, batch, 2)
        export_head(head, target, "vllm", tmp_path / f"export{n}")
        save_file({"input_ids": ids, "hidden": batch.aux_hidden.reshape(12, -1).contiguous(),
                   "expected": head.compute_logits(outs[0]).contiguous(),
                   "expected_step1": head.compute_logits(outs[1][1:]).contiguous()}, str(tmp_path / f"case{n}.st"))
        args += [str(tmp_path / f"export{n}"), str(tmp_path / f"case{n}.st")]
    run = subprocess.run([str(SERVING_PY), str(ROOT / "tests" / "serving_check.py"), "eagle3", args[0],
                          str(tmp_path / "target"), *args[1:]], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    results = [json.loads(line) for line in run.stdout.strip().splitlines() if line.startswith("{")]
    assert len(results) == len(combos) == 12
    for bits, result in zip(combos, results):
        assert result["rows"] == 11 + 10 and result["argmax_equal"], (bits, result)
        assert result["max_abs_diff"] < 1e-4, (bits, result)


@pytest.mark.parametrize("vocab", [64, None])
def test_speculators_loads_our_dflash_export_with_the_same_block_logits(tmp_path, vocab):
    """speculators' DFlashDraftModel, fed the aux states as vLLM captures them, gives our block logits
    at an anchor (its own anchored-block mask, context keys and RoPE): with a draft vocabulary (its
    lm_head the target's rows, d2t) and without (the verifier's lm_head)."""
    from headstart.heads.dflash import AnchoredBlocks

    make_hf_model("llama", tmp_path / "target", seed=4)
    target = load_llama(tmp_path / "target", "fp32")
    torch.manual_seed(1)
    head = build_head(HeadConfig(head_type="dflash", draft_vocab_size=vocab, aux_layer_ids=[0, 1, 2], num_layers=2,
                                 block_size=4), target)
    if vocab:
        head.set_vocab_maps(*build_vocab_maps(torch.rand(320), 64))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export_head(head, target, "vllm", tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    ids = torch.randint(0, 320, (16,), generator=torch.Generator().manual_seed(3))
    anchor = 7
    batch = target_forward(target, PackedBatch(ids, [16]), [0, 1, 2])
    with torch.no_grad():
        h = head.train_blocks(batch, AnchoredBlocks(torch.tensor([anchor]), torch.tensor([0]), 4))
        expected = head.compute_logits(h[1:])
    save_file({"input_ids": ids, "hidden": batch.aux_hidden.reshape(16, -1).contiguous(),
               "expected": expected.contiguous(), "anchor": torch.tensor(anchor)}, str(tmp_path / "case.safetensors"))
    run = subprocess.run([str(SERVING_PY), str(ROOT / "tests" / "serving_check.py"), "dflash", str(tmp_path / "export"),
                          str(tmp_path / "target"), str(tmp_path / "case.safetensors")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["rows"] == 3 and result["argmax_equal"]
    assert result["max_abs_diff"] < 1e-4, result
