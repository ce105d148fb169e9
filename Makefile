# Quick start: `make demo` and `make test` both set up .venv first (CPU torch when none is importable).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
# PyPI's torch for Linux x86_64 is the CUDA build (about 5.4 GB); PyTorch's CPU index adds 2.13.0+cpu, which pip
# prefers (a local version sorts after its release). Elsewhere (macOS) the index's build is PyPI's. The index is
# asked once first (5 s at most): pip retries an unreachable index for every package it resolves, each time up to
# its timeout, which on a machine whose firewall drops the packets would hold setup for many minutes.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.pgregistry-installed
# The Megatron-Core the parity and interop tests run against (tests/megatron). Releases from 0.17 on declare
# Python >= 3.12 and ship cp312 wheels only, but megatron/core is pure Python that runs on 3.11: the wheel's
# megatron/ is unpacked into the venv (no install, so pip's Python check does not apply). `import megatron.core`
# imports triton, which a CUDA torch brings along and the CPU wheel does not. MEGATRON_CORE= skips all of this.
MEGATRON_CORE ?= 0.19.2
TRITON ?= triton==3.9.0
MEGATRON_STAMP := $(VENV)/.megatron-core-$(MEGATRON_CORE)
# An older release, without the GTP fields, installed aside for tests/megatron/test_megatron_older_release.py.
MEGATRON_CORE_OLDER ?= 0.16.1
MEGATRON_OLDER_DIR := $(VENV)/megatron-core-$(MEGATRON_CORE_OLDER)

# The torchtitan tests/torchtitan run against. Its wheel is pure Python; its declared dependencies are those of its
# training loop (datasets, tokenizers, wandb, tensorboard, ...), which the meshes, models and parallelize functions
# pgregistry bridges do not import: it is installed without them, plus exactly what `import torchtitan.models` needs
# (spmd_types at the version it pins, tyro, einops; triton as for megatron-core). TORCHTITAN= skips all of this.
TORCHTITAN ?= 0.3.0
TORCHTITAN_DEPS ?= spmd_types==0.2.3 tyro==1.0.17 einops==0.8.2
TORCHTITAN_STAMP := $(VENV)/.torchtitan-$(TORCHTITAN)

# The trees the migration harness runs (tests/migrate/test_migrate_differential.py): Megatron-Bridge and NeMo as
# their pure-Python wheels hold them, unpacked (not installed: their dependencies are not needed, and stand in for
# what the harness's functions never use) into $(CORPUS_DIR)/<name>-<version>/. CORPUS= skips this.
CORPUS ?= megatron-bridge==0.6.2 nemo-toolkit==3.0.0
CORPUS_DIR := $(VENV)/corpus
space := $(empty) $(empty)
CORPUS_STAMP := $(CORPUS_DIR)/.$(subst $(space),_,$(subst ==,-,$(CORPUS)))

.PHONY: setup demo test lint allowlist-check bench mutants

setup: $(STAMP) $(if $(MEGATRON_CORE),$(MEGATRON_STAMP) $(MEGATRON_OLDER_DIR)) $(if $(TORCHTITAN),$(TORCHTITAN_STAMP)) \
	$(if $(CORPUS),$(CORPUS_STAMP))

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || { \
		if $(PY) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
			"$(TORCH_INDEX)" 2>/dev/null; then \
			$(PY) -m pip install -q --extra-index-url "$(TORCH_INDEX)" "$(TORCH_CPU)"; \
		else \
			echo "make setup: $(TORCH_INDEX) not reached in 5 s; torch from pip's own indexes" \
				"(on Linux x86_64 PyPI's is the CUDA build)" >&2; \
			$(PY) -m pip install -q "$(TORCH_CPU)"; \
		fi; }
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

$(MEGATRON_STAMP): $(STAMP)
	rm -rf $(VENV)/megatron-wheel
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d $(VENV)/megatron-wheel \
		"megatron-core==$(MEGATRON_CORE)"
	$(PY) tools/unpack_megatron_wheel.py $(VENV)/megatron-wheel/megatron_core-*.whl
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q --no-deps "$(TRITON)"
	touch $(MEGATRON_STAMP)

# Order-only: built once, when missing (a newer pyproject.toml does not touch it).
$(MEGATRON_OLDER_DIR): | $(STAMP)
	rm -rf $@.partial
	$(PY) -m pip install -q --no-deps --target $@.partial "megatron-core==$(MEGATRON_CORE_OLDER)"
	mv $@.partial $@

$(TORCHTITAN_STAMP): $(STAMP)
	$(PY) -m pip install -q $(TORCHTITAN_DEPS)
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q --no-deps "$(TRITON)"
	$(PY) -m pip install -q --no-deps "torchtitan==$(TORCHTITAN)"
	$(PY) -c "import torchtitan.models.qwen3"
	touch $(TORCHTITAN_STAMP)

$(CORPUS_STAMP): $(STAMP)
	rm -rf $(CORPUS_DIR)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d $(CORPUS_DIR)/wheels $(CORPUS)
	for wheel in $(CORPUS_DIR)/wheels/*.whl; do \
		$(PY) -m zipfile -e $$wheel $(CORPUS_DIR)/$$(basename $$wheel | cut -d- -f1-2) || exit 1; done
	touch $@

demo: $(STAMP)
	$(PY) -m examples.moe_demo

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check pgregistry examples tools
	$(VENV)/bin/mypy
	$(VENV)/bin/pgregistry allowlist check --no-cache
	PGREGISTRY_REQUIRE_MEGATRON=$(if $(MEGATRON_CORE),1,0) PGREGISTRY_OLDER_MEGATRON=$(abspath $(MEGATRON_OLDER_DIR)) \
		PGREGISTRY_REQUIRE_TORCHTITAN=$(if $(TORCHTITAN),1,0) PGREGISTRY_REQUIRE_CORPUS=$(if $(CORPUS),1,0) \
		PGREGISTRY_COMPILED_CHECKS=required $(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check pgregistry examples tools

allowlist-check: setup
	$(VENV)/bin/pgregistry allowlist check

# Every benchmark this machine can run alone, at its default sizes (some take many minutes; each one's --help gives
# smaller ones). Not the helpers (common.py, git_directories.py), nor those over a real tree's history, which need
# its git directory (allowlist_megatron.py, allowlist_replay.py, migrate_hand_migrations.py; migrate_megatron.py
# runs on the installed Megatron-Core); clip_verdict.py runs under torchrun.
BENCH_APART := common git_directories allowlist_megatron allowlist_replay migrate_hand_migrations migrate_megatron \
	clip_verdict
bench: setup
	for b in $(filter-out $(BENCH_APART:%=benchmarks/%.py),$(wildcard benchmarks/*.py)); do $(PY) $$b || exit 1; done
	$(PY) benchmarks/migrate_megatron.py --installed
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/clip_verdict.py

# Planted bugs (scripts/mutants.py): each applied to a copy of the repository, the tests listed for it must fail.
# One pytest run per mutant (scripts/mutants.py --only NAME runs those named); exit 1 when a mutant survives,
# 2 when the list went stale (docs/reliability.md, "Planted bugs").
mutants: setup
	$(PY) scripts/mutants.py
