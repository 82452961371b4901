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

DEMO := results/demo
# The main job: the shipped OpenAI-format requests through full KV and PASK at b = 0.33, then side by side.
# Reruns resume (answered custom_ids are skipped); delete $(DEMO) to run afresh.
demo: venv
	$(VENV)/bin/pask-jax fetch-model qwen2.5-coder-0.5b
	$(VENV)/bin/pask-jax run -i examples/requests.jsonl -o $(DEMO)/full.jsonl --method full
	$(VENV)/bin/pask-jax run -i examples/requests.jsonl -o $(DEMO)/pask-0.33.jsonl --method pask --budget 0.33
	$(VENV)/bin/pask-jax compare examples/requests.jsonl $(DEMO)/full.jsonl $(DEMO)/pask-0.33.jsonl

test: venv
	$(VENV)/bin/ruff check pask_jax tests scripts tools
	# Test files spread over two workers (one file stays on one worker: its module fixtures compile once).
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: venv
	$(VENV)/bin/ruff format --check pask_jax tests scripts tools
