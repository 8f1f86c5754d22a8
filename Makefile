# The two quick-start commands: `make report` (the main job) and `make test`.
# Each sets up $(VENV) on first use, installing torch before anything else, so that the build
# chosen here is the one kept. `make test-tl4` runs the suite again on TransformerLens 4.x,
# `make test-tl2` on TransformerLens 2.x (its own pins: requirements/tl2-constraints.txt).
PYTHON ?= python3
VENV ?= .venv
TL ?= transformer-lens==3.9.0
BIN := $(VENV)/bin
TORCH := torch==2.13.0
CONSTRAINTS ?= requirements/dev-constraints.txt
# Which torch build (README, "Installing torch"). Empty: what pip resolves for $(TORCH) as this
# machine configures it; from PyPI on Linux x86_64 that is the CUDA build (about 2.7 GB with its
# nvidia-* libraries). `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu`: the
# CPU-only build (about 190 MB); .../whl/cu126 and the like: that CUDA version's build.
TORCH_INDEX ?=
# The extras installed beside TransformerLens: `sae` (SAELens, for the tests of SAE features as
# attribution targets) where TransformerLens allows it (SAELens 6 needs TransformerLens < 4).
EXTRAS ?= dev,sae

.PHONY: setup report demo test test-tl4 test-tl2 pytest lint docs docs-serve

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(BIN)/pip install --quiet $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]" "$(TL)" -c $(CONSTRAINTS)
	touch $@

setup: $(VENV)/.installed

# The documentation site (mkdocs.yml, docs/): the `docs` extra in the same $(VENV), after the
# torch that setup installs; `mkdocs build --strict` turns every warning into an error.
# MathJax for the offline site: the static files of jupyter-server-mathjax, without the
# Jupyter server it extends (hence --no-deps; docs/hooks.py copies them into site/).
$(VENV)/.docs-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[docs]" "$(TL)" -c requirements/dev-constraints.txt
	$(BIN)/pip install --quiet --no-deps jupyter-server-mathjax -c requirements/dev-constraints.txt
	touch $@

# The tutorial pages: each notebook executed (inline figures) and rendered into the git-ignored
# docs/tutorials/ by docs/build_tutorials.py; redone when its notebook or the package changes.
TUTORIAL_PAGES := $(patsubst tutorials/%.ipynb,docs/tutorials/%.md,$(wildcard tutorials/[0-9]*.ipynb))
docs/tutorials/%.md: tutorials/%.ipynb docs/build_tutorials.py $(shell find tl_connwalk -name '*.py') | $(VENV)/.docs-installed
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python docs/build_tutorials.py $<

report: setup  # the main job: the geometry report of the default model (smollm2-135m)
	$(BIN)/tl-connwalk report --overwrite

demo: setup
	$(BIN)/tl-connwalk demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check tl_connwalk tests
	$(BIN)/mypy

test: lint pytest

pytest: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-tl4:
	$(MAKE) test VENV=.venv-tl4 TL=transformer-lens==4.3.0 EXTRAS=dev

# The suite without lint (ruff and mypy check the code against TransformerLens 3.x's types) and
# without the slow tests: the zoo's converted tokenizers need transformers 5, TransformerLens 2.x
# runs on transformers 4.
test-tl2:
	$(MAKE) pytest VENV=.venv-tl2 TL=transformer-lens==2.18.0 EXTRAS=dev \
		CONSTRAINTS=requirements/tl2-constraints.txt PYTEST_ARGS='-m "not slow"'

docs: $(VENV)/.docs-installed $(TUTORIAL_PAGES)  # NO_MKDOCS_2_WARNING: silence the theme's end-of-life banner
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(VENV)/.docs-installed $(TUTORIAL_PAGES)  # local preview at http://127.0.0.1:8000
	$(BIN)/mkdocs serve
