# Tandem: `make run` (the local demo) and `make test` (the test suite) work on a
# fresh machine with only Python: both create .venv and install into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/demo.yaml
# make run UP_FLAGS=--resume continues the demo run; UP_FLAGS=--fresh deletes it and starts over
UP_FLAGS ?=
# SGLang itself, without its (GPU) dependencies: the contract test reads its request structs.
SGLANG_SPEC ?= sglang==0.5.23

.PHONY: install run test test-fast bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	$(PIP) install -q --no-deps "$(SGLANG_SPEC)"
	touch $@

run: install
	$(VENV)/bin/tandem init-demo models/demo-ttt
	$(VENV)/bin/tandem up $(CONFIG) $(UP_FLAGS)

test: install
	$(VENV)/bin/ruff check services tests
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) tests/bench/run_benchmarks.py

lint: install
	$(VENV)/bin/ruff check services tests

clean:
	rm -rf runs checkpoints build
