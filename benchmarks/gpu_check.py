"""Helpers of benchmarks/gpu_check.sh: the random-weight targets and the conversations it runs on, a
wrapper that runs one `headstart` verb and records its peak memory, and the memory table.

    python benchmarks/gpu_check.py models OUT --shape 1b|tiny     # OUT/llama (+ tokenizer), OUT/deepseek
    python benchmarks/gpu_check.py chats OUT.jsonl --n 200 --min-chars 500 --max-chars 4000
    python benchmarks/gpu_check.py measure PEAK.json -- precompute RECIPE --set ...
    python benchmarks/gpu_check.py describe train|eval|generate FILE   # one line for the summary
    python benchmarks/gpu_check.py table RUN_DIR                   # measured peaks beside `headstart plan`

`measure` also records the most bytes one training micro-batch keeps for backward (autograd's saved
tensors of `HeadModule.losses`, distinct storages, parameters left out): on CPU, where there is no
device peak, `table` compares that with the plan's activation terms.

Nothing is downloaded: the tokenizer is a byte-level BPE built here, the weights are random.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
# Llama-3's special tokens at their Llama-3 offsets from the end of the vocabulary (128,000 of 128,256),
# so the 1B config's bos / eos ids (128000; 128001, 128008, 128009) name them.
LLAMA3_SPECIALS = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|start_header_id|>": 6,
                   "<|end_header_id|>": 7, "<|eom_id|>": 8, "<|eot_id|>": 9}
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# The tiny stand-in of the 1B shape (--cpu): the same config.json with small widths; 8 layers so that
# EAGLE-3's default aux layers (2, L // 2, L - 3) are three distinct ones, as on the 16-layer 1B.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512)
# A DeepSeek-V3-architecture target, small in depth and width but with V3's MLA latent widths
# (kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per cached token): what decides whether an
# attention backend can run it. q LoRA, sigmoid noaux_tc routing over 2 groups, a dense first layer, YaRN.
TINY_DEEPSEEK = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96,
                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     max_position_embeddings=4096,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                                      "mscale": 1.0, "mscale_all_dim": 1.0})
WORDS = ("hello speculative decoding heads draft target tokens fast the a of to and is in that it for on with "
         "model verify accept reject chain tree layer cache page memory batch step loss train").split()


def make_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly `vocab_size` ids and no merges (one token per byte):
    ids 0-255 are the bytes, Llama-3's specials sit at vocab_size - 256 + their Llama-3 offset, and the
    remaining ids are placeholders that decode to `<|reserved_N|>` (a random model does emit them)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = vocab_size - 256
    assert base >= 256, f"vocab_size {vocab_size} leaves no room for 256 byte tokens and 256 specials"
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # (256,) byte tokens
    specials = {name: base + off for name, off in LLAMA3_SPECIALS.items()}
    taken = set(specials.values())
    vocab.update(specials)
    vocab.update({f"<|reserved_{i}|>": i for i in range(256, vocab_size) if i not in taken})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  pad_token="<|end_of_text|>")
    tok.chat_template = LLAMA3_TEMPLATE
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok, specials


def _write_llama(out: Path, shape: str, device: str) -> None:
    """recipes/targets/llama-3.2-1b.json as it is (1b) or with small widths (tiny), random weights as
    safetensors under HF's names, and the tokenizer."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((ROOT / "recipes" / "targets" / "llama-3.2-1b.json").read_text())
    if shape == "tiny":
        base = TINY_LLAMA["vocab_size"] - 256
        cfg.update(TINY_LLAMA, bos_token_id=base, eos_token_id=[base + 1, base + 8, base + 9], torch_dtype="float32")
    tok, _ = make_tokenizer(cfg["vocab_size"])
    dtype = torch.bfloat16 if cfg["torch_dtype"] == "bfloat16" else torch.float32
    d, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                   p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                   p + "mlp.down_proj.weight": (d, inter),
                   p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], d)
    gen = torch.Generator(device).manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():  # norms near 1; matrices N(0, 0.02) as HF's initializer_range
        w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        w = 1 + 0.1 * w if name.endswith("norm.weight") else 0.02 * w
        tensors[name] = w.to(dtype).cpu().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save_pretrained(out)


def _write_deepseek(out: Path) -> None:
    """A tiny random DeepSeek-V3 (TINY_DEEPSEEK) through transformers' own class, with the tokenizer."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tok, specials = make_tokenizer(TINY_DEEPSEEK["vocab_size"])
    cfg = DeepseekV3Config(**TINY_DEEPSEEK, bos_token_id=specials["<|begin_of_text|>"],
                           eos_token_id=specials["<|eot_id|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # as tests/test_deepseek.py: every weight random, the logits informative
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08 if "gate.weight" in name else 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(-1 + 0.3 * torch.randn_like(b))
    model.save_pretrained(out)
    tok.save_pretrained(out)


def cmd_models(args: argparse.Namespace) -> int:
    """OUT/llama and OUT/deepseek; each directory is made under a temp name and renamed when complete,
    and one that exists already is reused (a model is a pure function of the shape and the seed)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, write in (("llama", lambda p: _write_llama(p, args.shape, device)), ("deepseek", _write_deepseek)):
        final = out / name
        if (final / "config.json").is_file():
            print(f"{final}: exists, reused")
            continue
        tmp = out / f".{name}.tmp-{os.getpid()}"
        write(tmp)
        tmp.rename(final)
        size = sum(f.stat().st_size for f in final.iterdir())
        print(f"{final}: {size / GB:.2f} GB")
    return 0


def cmd_chats(args: argparse.Namespace) -> int:
    """n ShareGPT-style rows of random words, each of min_chars..max_chars characters (the byte-level
    tokenizer makes that about as many tokens), 1-3 user / assistant rounds."""
    rng = random.Random(args.seed)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(args.n):
            budget, rounds = rng.randint(args.min_chars, args.max_chars), rng.randint(1, 3)
            turns = []
            for _ in range(rounds):
                for role, share in (("human", 0.25), ("gpt", 0.75)):
                    words, n, chars = [], int(budget * share / rounds), 0
                    while chars < n:
                        words.append(rng.choice(WORDS))
                        chars += len(words[-1]) + 1
                    turns.append({"from": role, "value": " ".join(words) or "hello"})
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    tmp.rename(path)
    return 0


sys.path.insert(0, str(ROOT))
from headstart.plan import ACTIVATION_TERMS  # noqa: E402 - plan's terms for what a micro-batch keeps


def _count_saved_bytes(peak: dict[str, float]) -> None:
    """Wrap HeadModule.losses so that each call's saved-tensor bytes raise peak["saved"] (bytes)."""
    import torch

    from headstart.train import module
    from headstart.train.saved import SavedBytes

    losses = module.HeadModule.losses

    def counted(self, *a, **kw):  # noqa: ANN001, ANN202
        if not torch.is_grad_enabled():
            return losses(self, *a, **kw)
        with SavedBytes(self.head, self.target) as kept:
            out = losses(self, *a, **kw)
        peak["saved"] = max(peak.get("saved", 0), kept.bytes)
        return out

    module.HeadModule.losses = counted


def cmd_measure(args: argparse.Namespace) -> int:
    """Run `headstart ARGS` in this process and write its peak memory to PEAK.json at exit: torch's
    peak allocated / reserved CUDA memory (what `headstart plan` adds up) and the host's peak RSS."""
    import atexit
    import resource
    import signal

    pid, peak_path = os.getpid(), Path(args.peak)
    saved: dict[str, float] = {}

    def record() -> None:
        if os.getpid() != pid:  # a forked DataLoader / datasets worker
            return
        rec = {"argv": args.argv[:1], "host_max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB}
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            rec["gpu_max_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
            rec["gpu_max_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
        if "saved" in saved:
            rec["saved_max_gb"] = saved["saved"] / GB
        peak_path.write_text(json.dumps(rec) + "\n")

    atexit.register(record)
    # `timeout` ends a step with SIGTERM: exit through SystemExit so that the peak so far is still written
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from headstart.cli import main as headstart_main

    if args.argv[:1] == ["train"]:
        _count_saved_bytes(saved)
    return headstart_main(args.argv)


def cmd_describe(args: argparse.Namespace) -> int:
    """One line about a finished step's output, for the summary."""
    try:
        print(_describe(args.kind, Path(args.file)))
    except (OSError, ValueError, KeyError, TypeError) as e:  # the step itself passed: say so, do not fail it
        print(f"(no summary of {args.file}: {type(e).__name__}: {str(e)[:80]})")
    return 0


def _describe(kind: str, path: Path) -> str:
    if kind == "train":
        m = json.loads(path.read_text())
        return f"step {m.get('step')}, engine tau {m.get('tau')}, val_loss {m.get('val_loss')}"
    if kind == "eval":
        r = json.loads(path.read_text())
        rows = [f"{x['method']} k={x['k']} tau {x.get('tau') or 0:.2f} {x.get('lossless_check', '')}".strip()
                for x in r["runs"] if x.get("k") and x.get("head")]
        return f"{r.get('engine', {}).get('backend')} attention; " + "; ".join(rows)
    # generate: its closing stderr line names the tokens, the speed and the attention backend
    lines = [x for x in path.read_text().splitlines() if " tokens in " in x and "attention on" in x]
    return lines[-1] if lines else f"no '... attention on ...' line in {path}"


OVER_PLAN = 3  # `table`'s exit status when a measured peak exceeds the plan (gpu_check.sh counts it a failure)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}" if x >= 10 else f"{x:.3f}"


def cmd_table(args: argparse.Namespace) -> int:
    """Each measured phase's peak beside the plan's per-rank total for the same phase (GB); exit status
    OVER_PLAN when a phase's measured peak (torch's max allocated, what the plan adds up) exceeds it."""
    run = Path(args.run)
    plan_file = run / "plan.json"
    plan, activations = {}, None
    if plan_file.is_file():
        try:
            raw = json.loads(plan_file.read_text())
            plan = {p["name"]: p["total"] / GB for p in raw["phases"]}
            train = next((p for p in raw["phases"] if p["name"] == "train" and "terms" in p), None)
            if train is not None:
                activations = sum(t["bytes"] for t in train["terms"] if t["name"] in ACTIVATION_TERMS) / GB
            print(f"plan: {raw['recipe']} (per rank, device {raw['device']}); "
                  f"shards {raw.get('disk_bytes_per_token') or 0:,.0f} bytes/token planned")
        except (ValueError, KeyError) as e:
            print(f"plan.json unreadable: {e}")
    # measured phase -> the plan phases it covers (validation runs inside training)
    rows = [("precompute", ("precompute",)), ("train", ("train", "validation")), ("eval", ("eval",)),
            ("deepseek-auto", ())]
    print(f"{'phase':<16}{'GPU alloc':>10}{'GPU resv':>10}{'nvidia-smi':>11}{'host RSS':>10}{'plan':>9}  plan phase(s)")
    over = []
    for name, phases in rows:
        f = run / "peaks" / f"{name}.json"
        if not f.is_file():
            continue
        m = json.loads(f.read_text())
        smi = run / "peaks" / f"{name}.smi"
        smi_gb = None
        if smi.is_file():
            vals = [int(v) for v in smi.read_text().split() if v.isdigit()]
            smi_gb = max(vals) * 2**20 / GB if vals else None
        planned = [plan[p] for p in phases if p in plan]
        what = " / ".join(f"{p} {_fmt(plan[p])}" for p in phases if p in plan)
        alloc = m.get("gpu_max_allocated_gb")
        exceeds = bool(planned) and isinstance(alloc, (int, float)) and alloc > max(planned)
        print(f"{name:<16}{_fmt(alloc):>10}{_fmt(m.get('gpu_max_reserved_gb')):>10}"
              f"{_fmt(smi_gb):>11}{_fmt(m.get('host_max_rss_gb')):>10}{_fmt(max(planned) if planned else None):>9}"
              f"  {what}" + ("  OVER PLAN" if exceeds else ""))
        if exceeds:
            over.append(f"{name} {alloc:.3f} GB > planned {max(planned):.3f} GB")
        kept = m.get("saved_max_gb")
        if name == "train" and isinstance(kept, (int, float)) and activations is not None:
            exceeds = kept > activations
            print(f"{'train saved':<16}{_fmt(kept):>10}{'-':>10}{'-':>11}{'-':>10}{_fmt(activations):>9}"
                  "  train activation terms (bytes one micro-batch keeps for backward)"
                  + ("  OVER PLAN" if exceeds else ""))
            if exceeds:
                over.append(f"train saved {kept:.3f} GB > planned activations {activations:.3f} GB")
    shards = run / "llama" / "precompute"
    if shards.is_dir():
        tokens = 0
        manifest = shards / "manifest.json"
        if manifest.is_file():
            tokens = sum(s.get("tokens", 0) for s in json.loads(manifest.read_text()).get("shards", []))
        size = sum(f.stat().st_size for f in shards.glob("shard-*.safetensors"))
        if tokens:
            print(f"shards: {size / tokens:,.0f} bytes/token measured ({tokens:,} tokens, {size / GB:.3f} GB)")
    print("GB = 1e9 bytes; GPU alloc/resv: torch.cuda.max_memory_{allocated,reserved} of the verb's process; "
          "nvidia-smi: the device's peak used memory sampled every 0.2 s (CUDA context included)")
    if over:
        print("peak over plan: " + "; ".join(over) + " (headstart plan under-counts this phase)")
        return OVER_PLAN
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = ap.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("models")
    p.add_argument("out")
    p.add_argument("--shape", choices=["1b", "tiny"], required=True)
    p.set_defaults(func=cmd_models)
    p = verbs.add_parser("chats")
    p.add_argument("out")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--min-chars", type=int, default=200)
    p.add_argument("--max-chars", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_chats)
    p = verbs.add_parser("measure")
    p.add_argument("peak")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_measure)
    p = verbs.add_parser("describe")
    p.add_argument("kind", choices=["train", "eval", "generate"])
    p.add_argument("file")
    p.set_defaults(func=cmd_describe)
    p = verbs.add_parser("table")
    p.add_argument("run")
    p.set_defaults(func=cmd_table)
    args = ap.parse_args(argv)
    if args.verb == "measure" and args.argv[:1] == ["--"]:
        args.argv = args.argv[1:]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
