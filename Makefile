# Quick start: `make demo` and `make test` both set up .venv first (CPU torch when none is importable).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
STAMP := $(VENV)/.pgregistry-installed

.PHONY: setup demo test lint allowlist-check bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: setup
	$(PY) -m examples.moe_demo

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pgregistry allowlist check
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .

allowlist-check: setup
	$(VENV)/bin/pgregistry allowlist check

bench: setup
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done
