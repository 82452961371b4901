# Two entry points (see README): `make demo` runs the main job, `make test` the test suite.
# Each (re)creates the virtualenv when pyproject.toml changed, then acts; both are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# bfcl-eval: its data and AST checker only; its declared dependencies are dozens of API clients.
	$(PY) -m pip install -q --no-deps bfcl-eval==2026.3.23
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/pask-jax fetch-model qwen2.5-coder-0.5b
	$(VENV)/bin/pask-jax demo --model qwen2.5-coder-0.5b -n 3
	# the main job on a short sample: grammar-constrained BFCL, full KV vs a compressed baseline
	$(VENV)/bin/pask-jax bfcl --model qwen2.5-coder-0.5b --methods full,snapkv --budget 0.33 --categories all \
		--limit 2 --max-new-tokens 96 --out results/demo_bfcl.json

test: venv
	$(VENV)/bin/ruff check pask_jax tests scripts
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff format --check pask_jax tests scripts
