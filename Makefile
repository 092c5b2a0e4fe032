# The two commands of a fresh machine: `make run` (main job) and `make test`.
# Both create and reuse the local venv in .venv; torch comes from the CPU wheel.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.labrl-installed

.PHONY: run test lint bench-envs clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: an unpinned torch would pull the CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev,chgnet,dft]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/labrl envs dry-run

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench-envs: $(STAMP)
	$(BIN)/python benchmarks/env_throughput.py

clean-venv:
	rm -rf $(VENV)
