# The two quick-start commands: `make demo` (the main job) and `make test`.
# Each sets up $(VENV) on first use, installing the CPU build of torch before anything that
# would pull a multi-GB CUDA build. `make test-tl4` runs the suite again on TransformerLens 4.x.
PYTHON ?= python3
VENV ?= .venv
TL ?= transformer-lens==3.9.0
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: setup demo test test-tl4 lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml requirements/dev-constraints.txt
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[dev]" "$(TL)" -c requirements/dev-constraints.txt
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/tl-connwalk demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check tl_connwalk tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

test-tl4:
	$(MAKE) test VENV=.venv-tl4 TL=transformer-lens==4.3.0
