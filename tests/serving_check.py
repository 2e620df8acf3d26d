"""Run inside the serving venv (`make serving-env`: speculators 0.9.0 and its transformers pin): load an
export with speculators' own classes and compare its first-step logits with ours.

    python serving_check.py eagle3|mtp|dflash EXPORT_DIR VERIFIER_DIR CASE.safetensors [EXPORT_DIR CASE ...]
CASE holds `input_ids` (T,), `hidden` (T, n_aux*H or H) and `expected` (our step-0 logits; dflash: the
draft slots of the block at `anchor`); an eagle3 CASE may hold `expected_step1`, our second TTT step's
logits at rows 1.. (speculators' step 1 at rows 0..: it feeds row i's output back with token i + 2).
Prints one JSON line per (EXPORT_DIR, CASE): {"max_abs_diff": ..., "argmax_equal": ...}.
"""

import json
import sys

import torch
from safetensors.torch import load_file


def main(kind: str, export_dir: str, verifier_dir: str, case_path: str) -> None:
    case = load_file(case_path)
    verifier = {}
    import glob

    for f in glob.glob(f"{verifier_dir}/*.safetensors"):
        verifier.update(load_file(f))
    ids, hidden = case["input_ids"].long(), case["hidden"].float()
    if kind == "eagle3":
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

        config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
        # Dense masks: the default flex-attention block mask is padded to 128 rows, which the second TTT
        # step's mask extension does not fit at this length.
        config.transformer_layer_config._attn_implementation = "eager"
        model = Eagle3DraftModel.from_pretrained(export_dir, config=config).float().eval()
        model.embed_tokens.weight.data.copy_(verifier["model.embed_tokens.weight"])
        seen = []
        model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o))
        t = ids.numel()
        steps = 2 if "expected_step1" in case else 1
        with torch.no_grad():  # row i = (features_i, t_{i+1})
            model(hidden_states=hidden[None, : t - 1], input_ids=ids[None, 1:], document_ids=torch.zeros(1, t - 1,
                  dtype=torch.long), ttt_steps=steps)
        got = seen[0][0]
        if steps == 2:  # the last row's step-1 token is speculators' padding
            want1 = case["expected_step1"].float()
            got, case["expected"] = torch.cat([got, seen[1][0][: want1.shape[0]]]), torch.cat([case["expected"], want1])
    elif kind == "dflash":  # one anchor at case["anchor"]: the only supervised row outside the last block
        from speculators.models.dflash import DFlashDraftModel

        model = DFlashDraftModel.from_pretrained(export_dir, attn_implementation="eager").float().eval()
        model.embed_tokens.weight.data.copy_(verifier["model.embed_tokens.weight"])
        if not model.use_draft_vocab:
            model.lm_head.weight.data.copy_(verifier.get("lm_head.weight", verifier["model.embed_tokens.weight"]))
        t, a, bs = ids.numel(), int(case["anchor"]), model.block_size
        loss_mask = torch.zeros(1, t, dtype=torch.long)
        loss_mask[0, a] = 1
        with torch.no_grad():
            _, logits, _, _, _ = model._backbone_forward(
                hidden[None], ids[None], loss_mask, torch.zeros(1, t, hidden.shape[-1] // 3),
                torch.zeros(1, t, dtype=torch.long), max_anchors=1)
        got = logits[0][1:bs]  # the draft slots of the block at the anchor
    else:
        from speculators.models.mtp import MTPDraftModel

        model = MTPDraftModel.from_pretrained(export_dir, attn_implementation="eager").float().eval()
        model.embed_tokens.weight.data.copy_(verifier["model.embed_tokens.weight"])
        model.lm_head.weight.data.copy_(verifier["lm_head.weight"])
        with torch.no_grad():
            logits, _, _ = model(input_ids=ids[None], hidden_states=hidden[None])
        got = logits[0][0]
    want = case["expected"].float()[: got.shape[0]]
    print(json.dumps({"rows": int(got.shape[0]), "max_abs_diff": float((got - want).abs().max()),
                      "argmax_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1)))}))


if __name__ == "__main__":
    kind, verifier = sys.argv[1], sys.argv[3]
    pairs = [sys.argv[2], sys.argv[4], *sys.argv[5:]]
    for export_dir, case_path in zip(pairs[::2], pairs[1::2]):
        main(kind, export_dir, verifier, case_path)
