# The two commands of a fresh machine: `make run` (main job) and `make test`.
# Both create and reuse the local venv in .venv; torch comes from the CPU wheel.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.labrl-installed

.PHONY: run test dry-run lint bench-envs clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: an unpinned torch would pull the CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev,chgnet,dft,dist]"
	touch $(STAMP)

# The quickstart: a tiny MoE learns XRD phase identification on CPU (~10-15 min),
# then the report's plots. An interrupted run resumes from its checkpoint.
run: $(STAMP)
	$(BIN)/labrl train configs/quickstart.yaml
	$(BIN)/labrl report runs/quickstart

# every registered env played with its gold (else random) policy
dry-run: $(STAMP)
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
