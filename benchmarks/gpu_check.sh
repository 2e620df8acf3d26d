#!/usr/bin/env bash
# The GPU check (issue 31): what headstart has never run on a GPU, run once on one CUDA device in
# about 8 minutes, each step with its own time limit and a PASS / FAIL / SKIP line, then a summary:
#   setup        .venv via `make setup` with a CUDA build of torch (see setup_env below)
#   flashinfer   flashinfer-python installed into .venv and importable
#   inputs       a random-weight target of Llama-3.2-1B's exact shape (recipes/targets/llama-3.2-1b.json,
#                byte-level tokenizer built here), a tiny random DeepSeek-V3 with V3's MLA widths, and
#                a JSONL of random conversations: benchmarks/gpu_check.py; nothing is downloaded
#   plan         `headstart plan` of the recipe below (per-rank GB by phase, shard bytes per token)
#   precompute   recipes/llama-3.2-1b-eagle3-8xh100.yaml with --set overrides: 1 rank, 300 rows, the
#   train        recipe's own batch sizes / max length / TTT / draft vocabulary; train 20 steps with
#   eval         trainer.strategy=fsdp (FSDP2 on 1 rank); eval chain + tree; export sglang + vllm
#   export
#   deepseek-*   `headstart generate` on the tiny DeepSeek with FlashInfer installed: `auto` must run
#                it (on torch attention: FlashInfer takes no MLA latent cache), `--backend flashinfer`
#                must be refused by name
#   cuda-tests   pytest -m cuda (FlashInfer against the torch backend; a skipped test is a FAIL here)
# and prints each phase's measured peak memory beside the plan's figure for it.
#
#   bash benchmarks/gpu_check.sh                 # on a CUDA machine (installs what it needs, see below)
#   bash benchmarks/gpu_check.sh --cpu           # dry run: the same steps on CPU at tiny shapes (~3 min)
#   options: --out DIR (default runs/gpu-check), --python PY (use this interpreter, install nothing),
#            --wheels DIR (offline: install from these wheels, no index; see setup_env),
#            --budget SECONDS for every step after the installs (default 480 on a GPU, none with --cpu):
#            a step gets at most what is left (else FAIL 'no time left'), so the summary always prints;
#            --only STEP,STEP,... runs those steps (and setup) alone. All of it takes more than one
#            10-minute device call (H200, 2026-12-04): run it as two calls on the warm machine,
#              --only flashinfer,inputs,plan,precompute,train,eval,export
#              --only flashinfer,inputs,deepseek-auto,deepseek-refusal,cuda-tests   (the models are reused)
#
# Every run writes into a new directory DIR/<mode>-<time>/ (logs/, peaks/, the run's outputs); the
# random models are kept in DIR/models-<shape>/ and reused. Nothing is ever deleted. Exit status: 0
# when no step failed, 1 otherwise.
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; }
MODE=gpu OUT_BASE="" PY_GIVEN="" WHEELS="${HEADSTART_WHEELS:-}" BUDGET="" ONLY=""
ALL_STEPS=",setup,flashinfer,inputs,plan,precompute,train,eval,export,deepseek-auto,deepseek-refusal,cuda-tests,"
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) MODE=cpu ;;
        --out) OUT_BASE=${2:?--out needs a directory}; shift ;;
        --python) PY_GIVEN=${2:?--python needs an interpreter}; shift ;;
        --wheels) WHEELS=${2:?--wheels needs a directory}; shift ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
        --only) ONLY=${2:?--only needs a comma-separated list of steps}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '${1:0:40}' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

[ -n "$BUDGET" ] || BUDGET=$([ "$MODE" = gpu ] && echo 480 || echo 0)
case $BUDGET in ''|*[!0-9]*) echo "gpu_check.sh: --budget takes whole seconds, got '${BUDGET:0:20}'" >&2; exit 2 ;; esac
BUDGET=$(echo "$BUDGET" | sed 's/^0*\([0-9]\)/\1/')  # decimal: a leading 0 would make bash read it as octal
if [ "${#BUDGET}" -gt 5 ] || [ "$BUDGET" -gt 86400 ]; then
    echo "gpu_check.sh: --budget $BUDGET: at most 86400 seconds (a day; the lent device has minutes)" >&2; exit 2
fi
for s in ${ONLY//,/ }; do
    case $ALL_STEPS in *",$s,"*) ;; *) echo "gpu_check.sh: --only: no step '${s:0:30}' (steps:${ALL_STEPS//,/ })" >&2; exit 2 ;; esac
done
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
    echo "gpu_check.sh: --wheels ${WHEELS:0:80}: no such directory (the wheels to install offline)" >&2; exit 2
fi
if [ -n "$PY_GIVEN" ] && ! command -v "$PY_GIVEN" >/dev/null 2>&1; then
    echo "gpu_check.sh: --python ${PY_GIVEN:0:80}: no such interpreter (give a python that runs headstart)" >&2; exit 2
fi

# --out is relative to where the script is called from; the default lies inside the repo.
[ -n "$OUT_BASE" ] || OUT_BASE="$(dirname "${BASH_SOURCE[0]}")/../runs/gpu-check"
mkdir -p "$OUT_BASE"
OUT_BASE=$(cd "$OUT_BASE" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
RUN=$OUT_BASE/$MODE-$(date +%Y%m%d-%H%M%S)
[ -e "$RUN" ] && RUN=$RUN-$$
mkdir -p "$RUN/logs" "$RUN/peaks" "$RUN/notes"
SHAPE=$([ "$MODE" = gpu ] && echo 1b || echo tiny)
MODELS=$OUT_BASE/models-$SHAPE
RECIPE=$REPO/recipes/llama-3.2-1b-eagle3-8xh100.yaml
if [ -n "$PY_GIVEN" ]; then PY=$(command -v "$PY_GIVEN" || echo "$PY_GIVEN"); else PY=$REPO/.venv/bin/python; fi
# The compiled CPU kernels are build products shared with the user's cache (as the tests do); data
# caches go into this run's directory.
export HEADSTART_KERNEL_CACHE="${HEADSTART_KERNEL_CACHE:-${HEADSTART_CACHE:-$HOME/.cache/headstart}/kernels}"
export HEADSTART_CACHE=$RUN/cache
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # --python: an interpreter without headstart installed
export MODE REPO RUN MODELS RECIPE PY PY_GIVEN WHEELS SHAPE

# The recipe as this check runs it. Both modes: one rank with FSDP2, 20 steps, our own data and target.
SETS=(--set "output_dir=$RUN/llama" --set "target.model=$MODELS/llama" --set "data.source=$RUN/chats.jsonl"
      --set train.max_steps=20 --set train.warmup_steps=2 --set train.val_every_steps=20
      --set train.ckpt_every_steps=20 --set trainer.devices=1 --set trainer.strategy=fsdp
      --set logging.wandb=false --set logging.every_steps=5)
if [ "$MODE" = gpu ]; then
    # The recipe's own batch sizes, max length 4096, TTT 7, 32k draft vocabulary and validation (64
    # prompts x 256 tokens): the peaks are comparable with the plan. 300 conversations of 500-4,000
    # tokens: ~500k training tokens for 20 steps of 16,384, ~75 held out.
    SETS+=(--set data.limit=300 --set data.heldout_fraction=0.25)
    CHATS=(--n 300 --min-chars 500 --max-chars 4000)
    EVAL_ARGS=(--heldout 32 --k 1,3 --spec chain,tree --max-tokens 64 --batch-size 32 --device cuda)
    GEN_ARGS=(--dtype bf16 --device cuda --max-tokens 32)
else
    SETS+=(--set data.limit=48 --set data.max_length=256 --set data.heldout_fraction=0.2 --set target.dtype=auto
           --set head.draft_vocab_size=128 --set head.k=2 --set precompute.batch_tokens=1024
           --set precompute.shard_tokens=4096 --set train.batch_tokens=512 --set train.ttt_steps=2
           --set train.val_prompts=4 --set train.val_max_tokens=8 --set train.val_loss_batches=2
           --set train.num_workers=0 --set trainer.accelerator=cpu --set trainer.precision=auto)
    CHATS=(--n 48 --min-chars 200 --max-chars 800)
    EVAL_ARGS=(--heldout 4 --k 1,2 --spec chain,tree --max-tokens 8 --batch-size 4 --device cpu)
    GEN_ARGS=(--dtype fp32 --device cpu --max-tokens 16)
fi
ARRAYS="$(declare -p SETS CHATS EVAL_ARGS GEN_ARGS)"

# ------------------------------------------------------------------------------------------ steps
# Each step body runs in its own bash under `timeout`: exit 0 = PASS, 77 = SKIP, anything else = FAIL.
# A body may write a one-line note to $RUN/notes/<step>.

hs() {  # hs STEP ARGS...: one headstart verb in a process that records its peak memory in peaks/STEP.json
    local step=$1; shift
    "$PY" "$REPO/benchmarks/gpu_check.py" measure "$RUN/peaks/$step.json" -- "$@"
}

# setup_env: a .venv whose torch is a CUDA build, headstart installed.
# - An existing .venv that imports headstart and sees the GPU is reused as it is.
# - Else `make setup`. Its TORCH_SPEC is the CPU machine's torch==2.13.0; on Linux, PyPI's wheel of
#   that version is the CUDA build, so `make setup` installs CUDA torch here. Where the base python
#   already holds a CUDA torch, .venv is made with --system-site-packages and TORCH_SPEC names that
#   version, so make keeps it: no second torch is installed.
# - The Makefile's stamp (.venv/.headstart-setup) records only that setup ran: if a CPU build is in
#   .venv anyway (a pip config's find-links, a venv made on the CPU machine), it is replaced by PyPI's
#   wheel of the same version with pip's configuration ignored, and the stamp stays valid. A later
#   `make setup` asks for torch==2.13.0, which 2.13.0+cuXXX satisfies (pip ignores the local label),
#   so it is not swapped back; every GPU run checks again anyway.
# - --wheels DIR (or HEADSTART_WHEELS): no index at all (a machine with no network): .venv over the
#   base python's CUDA torch with --system-site-packages, every wheel in DIR installed with --no-deps,
#   then headstart itself (--no-deps, --no-build-isolation). DIR must hold what the base python lacks:
#   flashinfer-python and its needs, datasets, ... (the import check below names what is missing).
setup_env() {
    local base=${PYTHON:-python3} cuda_torch="" ver
    if [ -n "$PY_GIVEN" ]; then
        echo "using $PY as given (--python): nothing installed"
    elif "$PY" -c 'import headstart.cli, torch; assert torch.cuda.is_available()' 2>/dev/null; then
        echo "reusing $REPO/.venv"
    else
        if "$base" -c 'import torch; assert torch.version.cuda and torch.cuda.is_available()' 2>/dev/null; then
            cuda_torch=$("$base" -c 'import torch; print(torch.__version__.split("+")[0])')
            if [ ! -x .venv/bin/python ]; then
                "$base" -m venv --system-site-packages .venv
                # --system-site-packages reaches the base *interpreter's* site-packages; where the base
                # python is itself a venv (the torch image's /opt/torch/.venv), its packages need a .pth.
                "$base" -c 'import site; print("\n".join(site.getsitepackages()))' \
                    >"$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_base_python.pth"
            fi
        fi
        if [ -n "$WHEELS" ]; then
            [ -n "$cuda_torch" ] || { echo "--wheels: $base has no CUDA torch to build .venv over" >&2; exit 1; }
            .venv/bin/python -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl
            .venv/bin/python -m pip install -q --no-index --no-deps --no-build-isolation -e .
        else
            make setup PYTHON="$base" TORCH_SPEC="torch==${cuda_torch:-2.13.0}"
        fi
    fi
    if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)'; then
        [ -z "$PY_GIVEN$WHEELS" ] || { echo "$PY's torch is a CPU build" >&2; exit 1; }
        ver=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
        echo "$PY has torch $ver, a CPU build: replacing it by PyPI's (CUDA) wheel of the same version"
        "$PY" -m pip uninstall -q -y torch
        env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
            "$PY" -m pip install -q "torch==$ver"
    fi
    "$PY" -c 'import torch, headstart.commands, datasets, lightning, transformers
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' | tee "$RUN/notes/setup"
}

setup_cpu() {  # --cpu: the venv this machine already has (make setup when there is none)
    [ -n "$PY_GIVEN" ] || "$PY" -c 'import headstart.cli' 2>/dev/null || make setup
    "$PY" -c 'import torch, headstart.commands; print("torch", torch.__version__)' | tee "$RUN/notes/setup"
}

flashinfer_env() {
    if [ "$MODE" = cpu ]; then echo "not installed in --cpu mode" >"$RUN/notes/flashinfer"; exit 77; fi
    if ! "$PY" -c 'import flashinfer' 2>/dev/null; then
        [ -z "$PY_GIVEN" ] || { echo "flashinfer is not importable by $PY (--python: nothing installed)" >&2; exit 1; }
        # pinned to the torch that is there: FlashInfer must not bring another one
        "$PY" -c 'import torch; print(f"torch=={torch.__version__}")' >"$RUN/torch-constraint.txt"
        if [ -n "$WHEELS" ]; then
            "$PY" -m pip install -q -c "$RUN/torch-constraint.txt" --no-index --find-links "$WHEELS" flashinfer-python
        else
            "$PY" -m pip install -q -c "$RUN/torch-constraint.txt" "flashinfer-python>=0.2"
        fi
    fi
    "$PY" -c 'import flashinfer, torch; print("flashinfer", flashinfer.__version__, "torch", torch.__version__)' \
        | tee "$RUN/notes/flashinfer"
}

cuda_tests() {
    if [ "$MODE" = cpu ]; then echo "no GPU in --cpu mode" >"$RUN/notes/cuda-tests"; exit 77; fi
    local rc=0
    "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider tests 2>&1 | tee "$RUN/logs/cuda-tests.pytest" || rc=$?
    tail -n 1 "$RUN/logs/cuda-tests.pytest" >"$RUN/notes/cuda-tests"
    [ "$rc" -eq 0 ] || exit "$rc"
    # A cuda test that skipped (no GPU seen, FlashInfer missing) did not check anything.
    if grep -q "skipped" "$RUN/logs/cuda-tests.pytest"; then echo "cuda tests skipped: see above" >&2; exit 1; fi
}

make_inputs() {
    eval "$ARRAYS"
    "$PY" "$REPO/benchmarks/gpu_check.py" models "$MODELS" --shape "$SHAPE"
    "$PY" "$REPO/benchmarks/gpu_check.py" chats "$RUN/chats.jsonl" "${CHATS[@]}"
    echo "$MODELS; $(wc -l <"$RUN/chats.jsonl") conversations" >"$RUN/notes/inputs"
}

plan() {
    eval "$ARRAYS"
    "$PY" -m headstart.cli plan "$RECIPE" "${SETS[@]}" --target-config "$MODELS/llama/config.json" \
        | tee "$RUN/plan.txt"
    tail -n 1 "$RUN/plan.txt" >"$RUN/notes/plan"
    "$PY" -m headstart.cli plan "$RECIPE" "${SETS[@]}" --target-config "$MODELS/llama/config.json" --json \
        >"$RUN/plan.json"
}

precompute() {
    eval "$ARRAYS"
    hs precompute precompute "$RECIPE" "${SETS[@]}"
}

train() {
    eval "$ARRAYS"
    hs train train "$RECIPE" "${SETS[@]}" --no-progress
    "$PY" "$REPO/benchmarks/gpu_check.py" describe train "$RUN/llama/metrics.json" | tee "$RUN/notes/train"
}

evaluate() {
    eval "$ARRAYS"
    hs eval eval "$RECIPE" "${SETS[@]}" --head "$RUN/llama/head-final" "${EVAL_ARGS[@]}" --no-progress \
        --out "$RUN/eval"
    "$PY" "$REPO/benchmarks/gpu_check.py" describe eval "$RUN/eval/report.json" | tee "$RUN/notes/eval"
}

export_head() {
    local fmt
    for fmt in sglang vllm; do
        "$PY" -m headstart.cli export "$RUN/llama/head-final" --format "$fmt" --model "$MODELS/llama" \
            --out "$RUN/export/$fmt"
    done
    echo "sglang, vllm: written and read back" >"$RUN/notes/export"
}

deepseek_auto() {  # the engine on the tiny DeepSeek with the default backend choice (FlashInfer installed)
    eval "$ARRAYS"
    hs deepseek-auto generate --model "$MODELS/deepseek" "${GEN_ARGS[@]}" \
        --prompt "Write a haiku about the sea" --prompt "Count from one to ten" 2>&1 | tee "$RUN/deepseek-auto.txt"
    "$PY" "$REPO/benchmarks/gpu_check.py" describe generate "$RUN/deepseek-auto.txt" | tee "$RUN/notes/deepseek-auto"
}

deepseek_refusal() {  # --backend flashinfer on the MLA target: refused by name (exit 2), not a crash
    eval "$ARRAYS"
    local rc=0
    "$PY" -m headstart.cli generate --model "$MODELS/deepseek" "${GEN_ARGS[@]}" --backend flashinfer \
        --prompt "Hi" >"$RUN/deepseek-refusal.txt" 2>&1 || rc=$?
    cat "$RUN/deepseek-refusal.txt"
    if [ "$rc" -ne 2 ] || ! grep -q "^headstart: error: .*flashinfer" "$RUN/deepseek-refusal.txt"; then
        echo "expected 'headstart: error: ...flashinfer...' and exit 2, got exit $rc" >&2
        exit 1
    fi
    grep "^headstart: error" "$RUN/deepseek-refusal.txt" | cut -c1-110 >"$RUN/notes/deepseek-refusal"
}
export -f hs setup_env setup_cpu flashinfer_env cuda_tests make_inputs plan precompute train evaluate export_head deepseek_auto \
    deepseek_refusal
export ARRAYS

SMI=""
if [ "$MODE" = gpu ] && command -v nvidia-smi >/dev/null; then SMI=1; fi
STEPS=() BUDGET_FROM=""
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 log=$RUN/logs/$1.log start=$SECONDS rc=0 smi_pid="" status left
    shift 2
    if [ -n "$ONLY" ] && [ "$name" != setup ]; then case ",$ONLY," in *",$name,"*) ;; *) return ;; esac; fi
    if [ "$BUDGET" -gt 0 ] && [ -n "$BUDGET_FROM" ]; then
        left=$((BUDGET - (SECONDS - BUDGET_FROM)))
        if [ "$left" -lt 15 ]; then
            echo "FAIL $name (0s): no time left in the ${BUDGET}s budget"
            STEPS+=("FAIL|$name|0|no time left in the ${BUDGET}s budget")
            return
        fi
        [ "$limit" -le "$left" ] || limit=$left
    fi
    echo "== $name (limit ${limit}s): $*"
    if [ -n "$SMI" ]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$RUN/peaks/$name.smi" 2>/dev/null &
        smi_pid=$!
    fi
    timeout -k 15 "$limit" bash -c 'set -euo pipefail; "$@"' "$name" "$@" >"$log" 2>&1 || rc=$?
    if [ -n "$smi_pid" ]; then kill "$smi_pid" 2>/dev/null || true; wait "$smi_pid" 2>/dev/null || true; fi
    case $rc in
        0) status=PASS ;;
        77) status=SKIP ;;
        124|137) status=FAIL; echo "timed out after ${limit}s" >"$RUN/notes/$name" ;;
        *) status=FAIL ;;
    esac
    local note=""
    [ -f "$RUN/notes/$name" ] && note=$(tail -n 1 "$RUN/notes/$name" | cut -c1-110)
    if [ "$status" = FAIL ]; then
        tail -n 25 "$log" | sed 's/^/    | /'
        [ -n "$note" ] || note="exit $rc: $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-100 || true)"
    fi
    printf '%s %s (%ds)%s\n' "$status" "$name" "$((SECONDS - start))" "${note:+: $note}"
    STEPS+=("$status|$name|$((SECONDS - start))|$note")
}

echo "gpu_check: $MODE mode, run directory $RUN"
T0=$SECONDS
if [ "$MODE" = gpu ]; then
    step setup 1500 setup_env
else
    step setup 900 setup_cpu
fi
step flashinfer 600 flashinfer_env
BUDGET_FROM=$SECONDS  # the installs above depend on the network; the budget counts what follows
# The recipe's run first, the cuda tests last: on the first run on an H200 (2026-12-04) FlashInfer
# compiled its kernels on first use (most likely the ~80 s before precompute's first batch), the cuda
# tests ran out of their 180 s on the third test, and train was then cut off by the budget. Now the
# recipe's steps build the kernels it uses, and the tests find those built.
step inputs 120 make_inputs
step plan 60 plan
step precompute 240 precompute
step train 300 train
step eval 240 evaluate
step export 180 export_head
step deepseek-auto 120 deepseek_auto
step deepseek-refusal 60 deepseek_refusal
step cuda-tests 420 cuda_tests

echo
echo "== summary ($MODE mode, $((SECONDS - T0)) s; logs in $RUN/logs)"
printf '%-6s %-16s %6s  %s\n' status step seconds note
failed=0
for s in "${STEPS[@]}"; do
    IFS='|' read -r status name secs note <<<"$s"
    printf '%-6s %-16s %6s  %s\n' "$status" "$name" "$secs" "$note"
    [ "$status" != FAIL ] || failed=$((failed + 1))
done
echo
echo "== peak memory per phase (GB) beside headstart plan"
table_rc=0
"$PY" "$REPO/benchmarks/gpu_check.py" table "$RUN" 2>&1 || table_rc=$?
if [ "$table_rc" -eq 3 ]; then  # a phase's measured peak exceeds headstart plan's
    echo "FAIL   memory-vs-plan: a measured peak exceeds headstart plan"; failed=$((failed + 1))
elif [ "$table_rc" -ne 0 ]; then
    echo "(no table: $PY could not run benchmarks/gpu_check.py)"
fi
echo
if [ "$failed" -gt 0 ]; then echo "gpu_check: $failed step(s) FAILED"; exit 1; fi
echo "gpu_check: no step failed"
