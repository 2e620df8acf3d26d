"""Precompute on the real SmolLM2-135M: the serving forward and the HF backend store the same hidden
states (within bf16 tolerance), on the repository's own recipe."""

from pathlib import Path

import pytest
import torch

from headstart.precompute import iter_shards, run_precompute, verify
from headstart.recipe_io import load_recipe

pytestmark = pytest.mark.real
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-mtp.yaml"


def test_engine_and_hf_backends_store_the_same_hidden_states(tmp_path):
    common = ["data.source=sharegpt", "data.limit=12", "data.max_length=96", "precompute.shard_tokens=100000",
              "head.type=eagle3"]
    shards = {}
    for backend in ("engine", "hf"):
        recipe = load_recipe(RECIPE, common + [f"precompute.backend={backend}",
                                                f"precompute.output_dir={tmp_path / backend}"])
        manifest = run_precompute(recipe, progress=False)
        verify(tmp_path / backend)
        assert manifest["captured"]["aux_layers"] == [2, 15, 27]
        shards[backend] = list(iter_shards(tmp_path / backend))
    for a, b in zip(shards["engine"], shards["hf"]):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        # Different kernels (ours vs HF eager/SDPA, both bf16): relative error at bf16 resolution.
        rel = (a.hidden.float() - b.hidden.float()).norm() / b.hidden.float().norm()
        assert rel < 0.02, rel
        rel_aux = (a.aux_hidden.float() - b.aux_hidden.float()).norm() / b.aux_hidden.float().norm()
        assert rel_aux < 0.02, rel_aux
