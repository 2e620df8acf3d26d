"""`headstart <verb> ...`: one verb per job; every verb that takes a recipe accepts `--set key=value`."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from headstart import __version__, commands, commands_engine
from headstart.errors import HeadstartError
from headstart.sizing import EVAL_BATCH


class _OnOff(argparse.BooleanOptionalAction):
    """--flag / --no-flag, given at most one way: both on one command line is an error, not the last one winning."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001, ANN204
        value = not option_string.startswith("--no-")
        if getattr(namespace, self.dest, None) not in (None, value):
            name = option_string.removeprefix("--no-").removeprefix("--")
            parser.error(f"--{name} and --no-{name} contradict each other: give one")
        setattr(namespace, self.dest, value)


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="a YAML recipe, e.g. recipes/smollm2-135m-mtp.yaml")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set data.max_length=512 (repeatable)",
    )


def _add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="shard the target over N tensor-parallel ranks (sets engine.tensor_parallel; launch N "
                        "processes: torchrun --nproc-per-node N -m headstart.cli ...)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headstart",
        description="Train draft heads for speculative decoding and measure them with the engine that serves them.",
    )
    parser.add_argument("--version", action="version", version=f"headstart {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    p = verbs.add_parser("assets", help="prepare and print the embedded defaults (model, data)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=commands.cmd_assets)

    p = verbs.add_parser("data", help="inspect what a recipe's data turns into")
    data_verbs = p.add_subparsers(dest="data_verb", metavar="ACTION", required=True)
    q = data_verbs.add_parser(
        "inspect", help="counts (read, skipped by reason, tokens, supervised) and a marked-up sample"
    )
    _add_recipe_args(q)
    q.add_argument("--limit", type=int, default=None, help="read only the first N rows (sets data.limit)")
    q.add_argument("--sample", type=int, default=None, help="index of the training conversation to show")
    q.add_argument("--json", action="store_true", help="print the numbers as JSON (no sample)")
    q.set_defaults(func=commands.cmd_data_inspect)

    p = verbs.add_parser("generate", help="generate completions with headstart's own engine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a user message (chat template applied); repeatable")
    src.add_argument("--prompts", help="JSONL: one {'prompt': ...} or {'messages': [...]} per line (+ id, category)")
    p.add_argument("--model", default="smollm2-135m", help="embedded name or local HF model directory")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seeds sampling (request i uses seed + i)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="auto: bf16 where the device computes it natively, else fp32")
    p.add_argument("--batch-size", type=int, default=8, help="sequences decoded together")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"])
    p.add_argument("--no-batch-invariant", action="store_true",
                   help="CPU: torch's matmuls for prefill (faster long prompts; a token's bits may then depend on "
                        "what shares its step, so greedy speculation can drift from greedy AR)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache budget (default: sized to the batch)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--raw", action="store_true", help="--prompt text is not wrapped in the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, then a summary object")
    p.add_argument("--spec", choices=["chain", "draft", "medusa", "tree", "ngram", "block"], default=None,
                   help="speculative decoding: a head chain, a draft model, Medusa heads, an EAGLE-2 tree, "
                        "prompt lookup (ngram: no model), or a DFlash block (block: k drafts in one forward)")
    p.add_argument("--head", default=None, help="head checkpoint directory (--spec chain / medusa / tree / block)")
    p.add_argument("--draft", default=None, help="draft model: name, HF directory or draft_lm head (--spec draft)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--draft-threshold", type=float, default=None,
                   help="chain / draft: stop a step's drafting once the draft's top probability falls below this")
    p.add_argument("--draft-sampling", action="store_true",
                   help="sample drafts from q and verify with the full-q rule (default: argmax + one-hot rule)")
    p.add_argument("--tree-topk", type=int, default=4, help="--spec tree: children expanded per node")
    p.add_argument("--tree-tokens", type=int, default=16, help="--spec tree: draft tokens verified per step")
    p.add_argument("--tree-depth", type=int, default=5, help="--spec tree: draft depth")
    p.add_argument("--allow-other-target", action="store_true",
                   help="use a head trained for a same-shaped target with other weights (warns)")
    p.set_defaults(func=commands_engine.cmd_generate)

    p = verbs.add_parser(
        "precompute", help="store the target's hidden states for a recipe (or: precompute verify|inspect DIR)",
        description="headstart precompute RECIPE [--resume] | precompute verify DIR | precompute inspect DIR",
    )
    p.add_argument("what", nargs="+", metavar="RECIPE | verify DIR | inspect DIR")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in the same output dir")
    _add_tp_arg(p)
    p.add_argument("--no-checksums", action="store_true", help="verify: sizes and shapes only (faster)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=commands.cmd_precompute)

    p = verbs.add_parser("regenerate", help="rewrite a recipe's assistant turns with the target itself")
    _add_recipe_args(p)
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run, or add rows to a finished one after raising regenerate.limit")
    p.add_argument("--engine", choices=["headstart", "vllm"], default=None,
                   help="decode with our engine or with vLLM (sets regenerate.engine; vllm: make vllm-env)")
    p.add_argument("--minutes", type=float, default=None,
                   help="a piece of a long run: stop after this long, resumable (conversations in flight are dropped)")
    p.add_argument("--pieces", default=None, metavar="DIR",
                   help="carry the run across machines: restore DIR's pieces first, save the new rows as a piece after")
    p.set_defaults(func=commands.cmd_regenerate)

    p = verbs.add_parser("train", help="fit the recipe's head (shards or online), validating with the engine")
    _add_recipe_args(p)
    p.add_argument("--resume", action="store_true", help="continue from output_dir/checkpoints/last.ckpt")
    p.add_argument("--minutes", type=float, default=None,
                   help="a piece of a long run (a time limit): checkpoint and stop at the first step after this "
                        "long; --resume continues it exactly")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    _add_tp_arg(p)
    p.set_defaults(func=commands.cmd_train)

    p = verbs.add_parser("head", help="create and inspect draft-head checkpoints")
    head_verbs = p.add_subparsers(dest="head_verb", metavar="ACTION", required=True)
    q = head_verbs.add_parser("init", help="build a head for a target (initialised from it) and save it")
    q.add_argument("--model", default="smollm2-135m", help="the target: embedded name or local directory")
    q.add_argument("--type", required=True,
                   choices=["mtp", "eagle1", "deepseek_mtp", "eagle3", "medusa", "draft_lm", "dflash"])
    q.add_argument("--block-size", type=int, default=None, help="dflash: positions per drafted block (default 8)")
    q.add_argument("--num-layers", type=int, default=1, help="decoder layers (draft_lm: its depth)")
    q.add_argument("--medusa-heads", type=int, default=4)
    q.add_argument("--postnorm-features", action="store_true",
                   help="mtp / deepseek_mtp: read the target's state after its final norm (what vLLM and SGLang feed "
                        "drafters; their layouts refuse a head trained on the pre-norm state)")
    # eagle3's EAGLE-3.1 norm flags; unset: the trainer's defaults (on, fc-norm off), which SGLang cannot serve.
    for flag, what in (("norm-before-fc", "one RMSNorm over the concatenated aux states before fc (SGLang: off)"),
                       ("fc-norm", "one RMSNorm per aux state before fc (default off)"),
                       ("norm-before-residual", "the first layer's residual is hidden_norm(f) (SGLang: off)"),
                       ("norm-output", "the next draft step is fed the post-norm state")):
        q.add_argument(f"--{flag}", action=_OnOff, default=None, help=f"eagle3: {what}")
    q.add_argument("--fc-bias", action=_OnOff, default=None,
                   help="eagle1: a bias on fc (default on, as the original EAGLE and SGLang; vLLM's drafter has none: "
                        "--no-fc-bias)")
    q.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="fp32")
    q.add_argument("--out", required=True, help="checkpoint directory to write (a new or empty directory)")
    q.add_argument("--force", action="store_true", help="replace --out if it is an existing head checkpoint")
    q.set_defaults(func=commands.cmd_head_init)

    p = verbs.add_parser("plan", help="what every rank of a recipe's jobs needs (memory by term, disk, throughput), "
                                      "before it runs; refuses what cannot fit")
    _add_recipe_args(p)
    _add_tp_arg(p)
    p.add_argument("--target-config", default=None, metavar="CONFIG_JSON",
                   help="the target's config.json (default: the recipe's target.model directory's); shapes only")
    p.add_argument("--device-memory-gb", type=float, default=80.0, help="memory per device (default: H100-80GB)")
    p.add_argument("--device-name", default="H100-80GB")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=commands.cmd_plan)

    p = verbs.add_parser("eval", help="acceptance and speed of heads vs plain decoding, with the engine")
    _add_recipe_args(p)
    _add_tp_arg(p)
    p.add_argument("--head", action="append", required=True, help="a head checkpoint directory (repeatable)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", help="JSONL with \"prompt\" or \"messages\" (+ optional \"category\") per row")
    src.add_argument("--heldout", type=int, default=32, help="first user turns of N held-out conversations")
    p.add_argument("--heldout-turn", type=int, default=None, metavar="T",
                   help="--heldout: the user turn before the T-th reply instead of the first, after the earlier turns "
                        "and their replies (of the held-out conversations with T replies within data.max_length)")
    p.add_argument("--k", default="1,2,3,4,5", help="draft lengths (tree: depths), comma-separated")
    p.add_argument("--temperature", default="0", help="temperatures, comma-separated")
    p.add_argument("--spec", default="chain",
                   help="chain, tree and/or adaptive (a chain that stops when the head is unsure) for chain heads, "
                        "comma-separated")
    p.add_argument("--draft-threshold", type=float, default=0.4,
                   help="--spec adaptive: stop drafting once the head's top probability falls below this")
    p.add_argument("--tree-tokens", type=int, default=16,
                   help="--spec tree: draft tokens verified per step (each step verifies this + 1 rows)")
    p.add_argument("--tree-topk", type=int, default=4, help="--spec tree: children expanded per node")
    p.add_argument("--repeats", type=int, default=1,
                   help="alternations of plain and speculative runs per batch group (timing; median reported)")
    p.add_argument("--no-baseline", action="store_true",
                   help="leave out the prompt-lookup (ngram) rows that show what speculation gives untrained")
    p.add_argument("--batch-size", type=int, default=EVAL_BATCH)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", help="report directory (default: <output_dir>/eval)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--allow-other-target", action="store_true",
                   help="evaluate heads trained for a same-shaped target with other weights (warns)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--engine", default="headstart",
                   help="headstart, vllm, or headstart,vllm: which engines run the prompts (vllm runs in its own "
                        "interpreter: make vllm-env, or $HEADSTART_VLLM_PYTHON)")
    p.add_argument("--vllm-threads", choices=["all", "default"], default="all",
                   help="vLLM's CPU threads: all cores, as our engine, or vLLM's own binding (one core reserved)")
    p.set_defaults(func=commands_engine.cmd_eval)

    p = verbs.add_parser("export", help="write a head in a serving engine's layout (checked by reading it back)")
    p.add_argument("head", help="a native head checkpoint directory")
    p.add_argument("--format", required=True, choices=["sglang", "vllm", "deepseek-mtp", "medusa", "hf", "native"])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m", help="the head's target: embedded name or local directory")
    p.add_argument("--force", action="store_true", help="replace --out if an earlier export wrote it")
    p.add_argument("--allow-other-target", action="store_true")
    p.set_defaults(func=commands.cmd_export)

    p = verbs.add_parser("import", help="turn a serving-layout checkpoint into a native head")
    p.add_argument("src", help="checkpoint directory (config.json + *.safetensors or pytorch_model*.bin)")
    p.add_argument("--format", required=True, choices=["sglang", "vllm", "eagle", "deepseek-mtp", "medusa", "hf"])
    p.add_argument("--target", default="smollm2-135m", help="the target: embedded name or local directory")
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="replace --out if it is a head checkpoint")
    p.add_argument("--allow-other-target", action="store_true",
                   help="import an export of a head made for a same-shaped target with other weights")
    p.set_defaults(func=commands.cmd_import)
    return parser


def main(argv: list[str] | None = None) -> int:
    from headstart.launch import end_rank, install_signal_handlers, launched_ranks

    if argv is not None:  # a library call: nothing about the process is ours to decide
        return _main(argv)
    try:
        install_signal_handlers()  # the command line itself: SIGTERM and Ctrl-C always end it
    except HeadstartError as e:  # a bad HEADSTART_TERM_GRACE_S: one line, before any verb (even --help)
        print(f"headstart: error: {e}", file=sys.stderr)
        return 2
    try:
        code = _main(None)
    except SystemExit as e:  # argparse; Lightning's sys.exit(1) after SIGTERM / Ctrl-C during fit
        if launched_ranks() <= 1:
            raise
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # an unexpected error: its traceback, then this rank ends as the others do
        if launched_ranks() <= 1:
            raise
        sys.excepthook(*sys.exc_info())
        code = 1
    # Checked after the verb: Lightning's own spawner sets WORLD_SIZE in this process during fit.
    if launched_ranks() > 1:
        end_rank(code)  # one rank of several must not abort in the interpreter's teardown (launch.end_rank)
    return code


def _main(argv: list[str] | None) -> int:
    from headstart.launch import Terminated

    args = build_parser().parse_args(argv)
    if getattr(args, "tp", None) is not None:
        args.overrides.append(f"engine.tensor_parallel={args.tp}")
    try:
        return args.func(args)
    except HeadstartError as e:
        print(f"headstart: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        print("headstart: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("headstart: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `headstart plan RECIPE | head`: the reader left; say nothing more
        if argv is not None:  # a library call: the caller's streams are not ours to redirect
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush too
        return 141
    except OSError as e:  # the file system refused a write this verb made: where and why, in one line
        if not (isinstance(e, PermissionError) or e.errno in _REFUSED_WRITES):
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"headstart: error: {where}{e.strerror or e} (check the path's permissions and the free space "
              "on its file system)", file=sys.stderr)
        return 2


_REFUSED_WRITES = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM}


if __name__ == "__main__":
    sys.exit(main())
