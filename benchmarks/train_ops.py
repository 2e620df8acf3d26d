"""What one training micro-batch launches: aten ops (the torch profiler on CPU: the count is what a GPU
launches), forward + backward of HeadModule.losses, for mtp TTT 3,
eagle3 TTT 3, dflash and a tiny DeepSeek (MLA + MoE) head, with the same rows packed as 1 and as 8
sequences. Ours (this tree) beside a baseline tree (a git revision checked out into a temporary worktree,
default: the commit before the issue-32 work), each in its own process, in one run.

    .venv/bin/python benchmarks/train_ops.py                  # baseline 91e691a
    .venv/bin/python benchmarks/train_ops.py --baseline HEAD~3 --tokens 512
    .venv/bin/python benchmarks/train_ops.py --saved --baseline d3b35db --tokens 2048   # bytes kept, not ops

`--saved`: what one micro-batch keeps for backward instead (autograd's saved tensors, distinct storages,
parameters left out), for the rows packed as one long sequence with many short ones (half the rows in one
sequence, the rest in 16-token ones: what packing makes of a realistic length mix) and as two even ones.

The models are random, tiny in width (the op count does not depend on width) and built here; nothing is
downloaded. Host syncs are not in this table: on CPU a host-side mask and a device mask are the same
kind of tensor; tests/test_train_parts.py counts the training step's (one per micro-batch) with
headstart.train.syncs, and with torch's sync detector on CUDA.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Ops that only make a view or read metadata: no kernel launches for them on a GPU.
VIEWS = {"aten::as_strided", "aten::view", "aten::reshape", "aten::t", "aten::transpose", "aten::slice",
         "aten::narrow", "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::detach", "aten::resolve_conj",
         "aten::resolve_neg", "aten::result_type", "aten::expand", "aten::alias", "aten::permute", "aten::unbind",
         "aten::split", "aten::chunk", "aten::_unsafe_view", "aten::lift_fresh", "aten::empty", "aten::empty_strided",
         "aten::to", "aten::contiguous", "aten::flatten", "aten::view_as", "aten::numpy_T", "aten::is_nonzero"}
CASES = {  # name: (head type, ttt steps, extra head fields, target family)
    "mtp TTT 3": ("mtp", 3, {}, "llama"),
    "eagle3 TTT 3": ("eagle3", 3, {"aux_layer_ids": [0, 1, 2]}, "llama"),
    "dflash (block 4)": ("dflash", 1, {"aux_layer_ids": [0, 1, 2], "block_size": 4}, "llama"),
    "deepseek_mtp TTT 3 (MLA + MoE)": ("deepseek_mtp", 3, {}, "deepseek"),
}


def _models(root: Path) -> dict[str, Path]:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

    dirs = {"llama": root / "llama", "deepseek": root / "deepseek"}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
                     ).save_pretrained(dirs["llama"])
    DeepseekV2ForCausalLM(DeepseekV2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=None, topk_method="greedy")).save_pretrained(dirs["deepseek"])
    return dirs


def _cases(model_dirs: dict[str, str], chunk: int):  # noqa: ANN202 - yields (name, head, target, module, batch_of)
    """Each case's head, target and HeadModule, and a builder of its micro-batch from sequence lengths.
    Runs inside the tree under test, so it uses only what the baseline tree has too."""
    import torch

    from headstart.heads import HeadConfig, PackedBatch, build_head
    from headstart.models import load_target
    from headstart.recipe_io import recipe_from_dict
    from headstart.train.module import HeadModule, target_forward

    torch.manual_seed(0)
    targets = {k: load_target(v, "fp32") for k, v in model_dirs.items()}
    for name, (kind, ttt, extra, family) in CASES.items():
        target = targets[family]
        head = build_head(HeadConfig(head_type=kind, **extra), target)
        recipe = recipe_from_dict({"head": {"type": kind, **extra},
                                   "train": {"ttt_steps": ttt, "loss_chunk_tokens": chunk}})

        def batch_of(lens: list[int], seed: int, target=target, extra=extra):  # noqa: ANN001, ANN202
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(2, 500, (sum(lens),), generator=g)
            mask = (torch.rand(sum(lens), generator=g) > 0.3).long()
            return target_forward(target, PackedBatch(ids, lens, None, None, mask),
                                  list(extra.get("aux_layer_ids", [])))

        yield name, head, target, HeadModule(recipe, target, head), batch_of


def measure(model_dirs: dict[str, str], tokens: int, chunk: int = 256) -> dict[str, dict[str, int]]:
    """Runs inside the tree under test (its headstart is on sys.path)."""
    import torch
    from torch.profiler import profile

    torch.set_num_threads(1)
    out: dict[str, dict[str, int]] = {}
    for name, head, _, module, batch_of in _cases(model_dirs, chunk):
        for seqs in (1, 8):
            batch = batch_of([tokens // seqs] * seqs, seqs)
            loss, _ = module.losses(batch, with_stats=False)  # warm-up: caches, lazy inits
            loss.backward()
            head.zero_grad(set_to_none=True)
            with profile() as prof:
                loss, _ = module.losses(batch, with_stats=False)
                loss.backward()
            events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
            out[f"{name} | {seqs} seq"] = {"ops": sum(e.count for e in events),
                                           "compute": sum(e.count for e in events if e.key not in VIEWS)}
            head.zero_grad(set_to_none=True)
    return out


def measure_saved(model_dirs: dict[str, str], tokens: int, chunk: int = 256) -> dict[str, dict[str, int]]:
    """Runs inside the tree under test: bytes autograd saves for HeadModule.losses, per case and length mix
    (headstart.train.saved counts the same; the baseline tree predates it, so it is written out here)."""
    import torch

    out: dict[str, dict[str, int]] = {}
    mixes = {"mixed": [tokens // 2] + [16] * (tokens // 32), "even": [tokens // 2] * 2}
    for name, head, target, module, batch_of in _cases(model_dirs, chunk):
        params = {p.untyped_storage().data_ptr() for m in (head, target) for p in m.parameters()}
        for mix, lens in mixes.items():
            batch = batch_of(lens, 0)
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor, params: set[int] = params, seen: dict[int, int] = seen) -> torch.Tensor:
                st = t.untyped_storage()
                if st.data_ptr() not in params:
                    seen[st.data_ptr()] = st.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss, _ = module.losses(batch, with_stats=False)
            out[f"{name} | {mix}"] = {"bytes": sum(seen.values())}
            del loss
    return out


def main_saved(args: argparse.Namespace) -> None:
    from common import baseline_tree, measure_in_tree

    with tempfile.TemporaryDirectory(prefix="headstart-train-saved-") as tmp:
        models = {k: str(v) for k, v in _models(Path(tmp) / "models").items()}

        def run(tree: Path) -> dict[str, dict[str, int]]:
            return measure_in_tree(tree, f"train_ops.measure_saved({models!r}, {args.tokens})", 1800,
                                   OMP_NUM_THREADS="1")

        with baseline_tree(args.baseline) as base:
            before = run(base)
        after = run(ROOT)
    print(f"bytes kept for backward per micro-batch ({args.tokens} rows; mixed: one {args.tokens // 2}-token "
          f"sequence + {args.tokens // 32} of 16 tokens; even: two of {args.tokens // 2}), fp32, baseline "
          f"{args.baseline} vs this tree")
    print("| case | mix | saved MB before | after | before / after |")
    print("|---|---|---|---|---|")
    for key, b in before.items():
        name, mix = key.split(" | ")
        a = after[key]["bytes"]
        print(f"| {name} | {mix} | {b['bytes'] / 1e6:,.1f} | {a / 1e6:,.1f} | {b['bytes'] / max(a, 1):.1f}x |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="91e691a", help="git revision of the baseline tree")
    ap.add_argument("--tokens", type=int, default=256, help="rows per micro-batch (split into 1 or 8 sequences)")
    ap.add_argument("--saved", action="store_true", help="bytes kept for backward instead of ops (module docstring)")
    args = ap.parse_args()
    if args.saved:
        main_saved(args)
        return
    from common import baseline_tree, measure_in_tree

    sys.path.insert(0, str(ROOT))
    from headstart.sizing import loss_chunk_rows

    # This tree also runs at the loss chunk a GPU takes by default (train.loss_chunk_tokens null) for a
    # 32,000-row draft vocabulary and TTT 3 (the eagle3 recipes' vocabulary); the baseline's was 256 everywhere.
    gpu_chunk = loss_chunk_rows(None, 32000, 3, "cuda", args.tokens)
    with tempfile.TemporaryDirectory(prefix="headstart-train-ops-") as tmp:
        models = {k: str(v) for k, v in _models(Path(tmp) / "models").items()}

        def run(tree: Path, chunk: int) -> dict[str, dict[str, int]]:
            return measure_in_tree(tree, f"train_ops.measure({models!r}, {args.tokens}, {chunk})", 1800,
                                   OMP_NUM_THREADS="1")

        with baseline_tree(args.baseline) as base:
            before = run(base, 256)
        after, after_gpu = run(ROOT, 256), run(ROOT, gpu_chunk)
    print(f"aten ops per micro-batch (forward + backward of HeadModule.losses, {args.tokens} rows), "
          f"baseline {args.baseline} vs this tree at the same loss chunk (256 rows) and at a GPU's default "
          f"({gpu_chunk} rows)")
    print("| case | sequences | aten ops before | after | before / after | after, GPU chunk | before / after | "
          "without views: before | after | after, GPU chunk |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, b in before.items():
        name, seqs = key.split(" | ")
        a, g = after[key], after_gpu[key]
        print(f"| {name} | {seqs.split()[0]} | {b['ops']:,} | {a['ops']:,} | {b['ops'] / max(a['ops'], 1):.1f}x | "
              f"{g['ops']:,} | {b['ops'] / max(g['ops'], 1):.1f}x | {b['compute']:,} | {a['compute']:,} | "
              f"{g['compute']:,} |", flush=True)


if __name__ == "__main__":
    main()
