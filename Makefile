# longspark-serve: set-up, serving and tests. Every target installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# On a machine without CUDA, install the CPU torch wheel first so pip never pulls a CUDA build.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test test-fast test-gpu lint model clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
ifeq ($(HAS_CUDA),)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
endif
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

model: install
	$(BIN)/longspark model fetch

serve: model
	$(BIN)/longspark serve

test: model
	$(BIN)/python -m pytest -q --durations=15 tests

# tests/gpu (skipped without CUDA, also under `make test`); deploy/gpu-check.sh runs it too
test-gpu: model
	$(BIN)/python -m pytest -q -m gpu tests/gpu

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests/unit

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
