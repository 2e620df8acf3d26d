"""How a chain head should start: held-out KL / top-1 at step 0 and after a few equal steps, and the
engine's tau, for each initialisation, on the same SmolLM2 batches, one run.

    .venv/bin/python benchmarks/init.py                      # mtp head, 12 steps x 2048 tokens
    .venv/bin/python benchmarks/init.py --steps 20 --head eagle1

Variants (all keep the target's final norm before the lm_head where the family has one):
  scaled        (the default) the target's last layer copied, the fusion a scaled identity on the
                hidden half, so the copied layer reads a residual stream of the size it was trained on
  unscaled      the same with an unscaled identity (the default before this benchmark)
  copy_zero_out scaled, with the copied layer's output projections (o_proj, down_proj) zeroed: the
                layer starts as the identity, so the head starts by repeating the target's state
  default_fc    the copied layer, the fusion at torch's default (random) init
  random        every weight at torch's default init, norms at 1
eagle3, medusa and draft_lm (no fusion of the last state) have their own (OWN_START):
  default       build_head's init
  fc_high       eagle3: fc the identity on the deepest aux state, attention output zeroed
  norm0         the norm before the lm_head at zero: the head starts uniform (KL = log V - H(p))
  tempered      that norm (Medusa: its draft lm_head rows) at 1/4: the default's prediction, softened
  copy_zero_out draft_lm: its copied layers with their output projections zeroed
  a+b           both (fc_high+tempered)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

# Families whose variants differ from the chain families' (own fusion of aux states, no fusion, or
# no decoder layer); their "default" is build_head's init.
OWN_START = {"eagle3": "default,fc_high,norm0,tempered,fc_high+tempered,random", "medusa": "default,tempered",
             "draft_lm": "default,norm0,tempered,copy_zero_out,random"}


def _variant(name: str, kind: str, target, draft_vocab: int | None, maps):  # noqa: ANN001
    import torch

    from headstart.heads import HeadConfig, build_head
    from headstart.heads.base import init_from_last_layers, init_fusion_as_identity, zero_output_projections

    n = target.config.num_hidden_layers
    cfg = HeadConfig(head_type=kind, draft_vocab_size=draft_vocab,
                     aux_layer_ids=[2, n // 2, n - 3] if kind == "eagle3" else None)
    torch.manual_seed(0)
    if kind in OWN_START:
        head = build_head(cfg, target, init_from_target=name != "random")
        if draft_vocab:
            head.set_vocab_maps(*maps)
        parts = set(name.split("+"))  # variants compose: fc_high+tempered
        with torch.no_grad():
            if parts & {"norm0", "tempered"}:  # the norm before the lm_head (Medusa: the lm_head rows)
                w = head.lm_head.weight if kind == "medusa" else head.norm.weight
                w.mul_(0.0 if "norm0" in parts else 0.25)
            if "fc_high" in parts:  # eagle3: f = the deepest aux state, the attention's output zeroed
                d = target.config.hidden_size
                head.fc.weight.zero_()
                head.fc.weight[:, -d:] = torch.eye(d, dtype=head.fc.weight.dtype)
                for layer in head.layers:
                    layer.self_attn.o_proj.weight.zero_()
            if "copy_zero_out" in parts:
                zero_output_projections(head.layers)
        return head.float()
    if name == "random":
        head = build_head(cfg, target, init_from_target=False)
    elif name in ("scaled", "unscaled", "copy_zero_out"):
        init = "copy_zero_out" if name == "copy_zero_out" else "copy"
        head = build_head(cfg, target, init_from_target=True, init=init)
        if name == "unscaled":
            init_fusion_as_identity(head.fc if hasattr(head, "fc") else head.eh_proj)
    else:  # default_fc
        head = build_head(cfg, target, init_from_target=False)
        init_from_last_layers(head.layers, target)
        norm = getattr(head, "norm", None) or getattr(getattr(head, "shared_head", None), "norm", None)
        if norm is not None:
            with torch.no_grad():
                norm.weight.copy_(target.model.norm.weight)
    if draft_vocab:
        head.set_vocab_maps(*maps)
    return head.float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="mtp", choices=["mtp", "eagle1", "deepseek_mtp", *OWN_START])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--variants", default=None, help="default: every variant of the family")
    args = ap.parse_args()
    args.variants = args.variants or OWN_START.get(args.head, "scaled,unscaled,copy_zero_out,default_fc,random")
    if args.head == "draft_lm":
        args.draft_vocab = 0  # a draft model keeps the target's vocabulary

    import torch

    from headstart.assets import resolve_model
    from headstart.data.dataset import build_dataset
    from headstart.hardware import describe, resolve_dtype
    from headstart.heads import build_vocab_maps
    from headstart.models.llama import load_llama
    from headstart.recipe_io import recipe_from_dict
    from headstart.train.data import PackedStream, TokenSequences, pack
    from headstart.train.module import HeadModule, target_forward
    from headstart.train.validate import engine_acceptance, heldout_prompts

    dtype = resolve_dtype("auto")
    model_dir = resolve_model("smollm2-135m")
    target = load_llama(model_dir, dtype)
    recipe = recipe_from_dict({"data": {"source": "sharegpt", "max_length": 1024, "limit": 600,
                                        "heldout_fraction": 0.05, "split_key": "id_prefix"},
                               "train": {"ttt_steps": 1, "lr": args.lr}})
    built = build_dataset(recipe.data, str(model_dir), progress=False)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    t0 = time.perf_counter()
    n = target.config.num_hidden_layers
    aux = [2, n // 2, n - 3] if args.head == "eagle3" else []
    batches = []
    for item in PackedStream(TokenSequences.from_dataset(built.train), args.batch_tokens, seed=0):
        with torch.no_grad(), autocast:
            batches.append(target_forward(target, item["batch"], aux))
        if len(batches) == args.steps:
            break
    held = TokenSequences.from_dataset(built.heldout)
    val = [target_forward(target, held.load(b), aux) for b in pack(list(range(len(held.ids))), held.lengths,
                                                                  args.batch_tokens)[:2]]
    prompts = heldout_prompts(held.ids, held.masks, args.prompts)
    counts = torch.zeros(target.config.vocab_size, dtype=torch.float64)
    for ids, mask in zip(built.train["input_ids"], built.train["loss_mask"]):
        counts += torch.bincount(torch.tensor(ids)[torch.tensor(mask, dtype=torch.bool)],
                                 minlength=counts.numel()).double()
    maps = build_vocab_maps(counts, args.draft_vocab) if args.draft_vocab else None
    print(f"{args.head} head, SmolLM2-135M ({dtype}, {describe('cpu')}); {args.steps} steps x {args.batch_tokens} "
          f"tokens, AdamW lr {args.lr}; draft vocab {args.draft_vocab or 'full'}; {len(prompts)} held-out prompts x "
          f"{args.max_tokens} tokens greedy, k=3 (batches ready in {time.perf_counter() - t0:.0f}s); log V = "
          f"{math.log(target.config.vocab_size):.2f}")
    print(f"{'init':<15}{'KL@0':>8}{'top1@0':>8}{'KL@end':>8}{'top1@end':>10}{'tau@end':>9}{'s/step':>8}")
    for name in args.variants.split(","):
        head = _variant(name, args.head, target, args.draft_vocab or None, maps)
        module = HeadModule(recipe, target, head)
        with autocast:  # as the trainer's validation runs them
            start = module.heldout_metrics(val)
        opt = torch.optim.AdamW(head.trainable_parameters(), lr=args.lr, betas=(0.9, 0.95))
        t = time.perf_counter()
        for b in batches:
            with autocast:
                loss, _ = module.losses(b, with_stats=False)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.trainable_parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        per_step = (time.perf_counter() - t) / max(len(batches), 1)
        with autocast:
            end = module.heldout_metrics(val)
        acc = engine_acceptance(target, head, prompts, k=3, max_tokens=args.max_tokens)
        print(f"{name:<15}{start['val_loss']:>8.2f}{start['top1_per_step'][0]:>8.3f}{end['val_loss']:>8.2f}"
              f"{end['top1_per_step'][0]:>10.3f}{acc['tau']:>9.3f}{per_step:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
