# Tandem: `make run` (the local demo) and `make test` (the test suite) work on a
# fresh machine with only Python: both create .venv and install into it first.
# `make run` installs torch and the core (what the demo needs); `make test` installs tandem[dev] (every extra).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
# torch comes from pip's index: PyPI's default Linux x86-64 wheel is the CUDA build. For the CPU build:
#   make run TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
TORCH_PIP := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
CONFIG ?= configs/demo.yaml
# make run UP_FLAGS=--resume continues the demo run; UP_FLAGS=--fresh deletes it and starts over
UP_FLAGS ?=
# pytest-xdist workers for make test (the machines have 2 cores)
TEST_WORKERS ?= 2
# SGLang itself, without its (GPU) dependencies: the contract test reads its request structs.
SGLANG_SPEC ?= sglang==0.5.23
# tinker-cookbook, a CLIENT of `tandem serve`, in a virtualenv of its own: it pins transformers<=5.5.4,
# older than the project's. tests/test_tinker_cookbook.py runs one of its recipes from there.
COOKBOOK_VENV ?= build/cookbook-venv
COOKBOOK_SPEC ?= tinker==0.38.0 tinker-cookbook==0.5.8 transformers==5.5.4 textarena==0.7.4
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed-$(shell echo '$(TORCH_SPEC) $(COOKBOOK_SPEC)' | md5sum | cut -c1-12)

# the dashboard's chart library, vendored from npm into the package (make dashboard-assets; committed)
UPLOT_VERSION ?= 1.6.32
DASH_VENDOR := services/coordinator/dashboard/static/vendor
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install install-run run test test-fast bench lint clean browser dashboard-assets cookbook-venv docs docs-gen

install: $(VENV)/.installed
install-run: $(VENV)/.installed-run

# the demo's install: torch, then the core dependencies only
$(VENV)/.installed-run: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIP) "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e .
	touch $@

# everything the suite needs: every extra, the test tools, SGLang's wheel for its contract test
$(VENV)/.installed: $(VENV)/.installed-run
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	$(PIP) install -q --no-deps "$(SGLANG_SPEC)"
	touch $@

cookbook-venv: $(COOKBOOK_STAMP)

$(COOKBOOK_STAMP):
	rm -rf $(COOKBOOK_VENV)
	$(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/python -m pip install -q $(TORCH_PIP) "$(TORCH_SPEC)"
	$(COOKBOOK_VENV)/bin/python -m pip install -q $(COOKBOOK_SPEC)
	touch $@

run: install-run
	$(VENV)/bin/tandem init-demo models/demo-ttt
	$(VENV)/bin/tandem up $(CONFIG) $(UP_FLAGS)

# Debian's chromium and its driver for the dashboard's browser test; installed only when missing.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "chromium and chromedriver: present"; \
	else \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q \
			chromium chromium-driver fonts-dejavu-core; \
	fi

dashboard-assets:
	tmp=$$(mktemp -d) && cd $$tmp && npm pack -q uplot@$(UPLOT_VERSION) && tar xzf uplot-$(UPLOT_VERSION).tgz && \
	cd - >/dev/null && cp $$tmp/package/dist/uPlot.iife.min.js $$tmp/package/dist/uPlot.min.css $(DASH_VENDOR)/ && \
	cp $$tmp/package/LICENSE $(DASH_VENDOR)/uPlot.LICENSE && rm -rf $$tmp

test: install browser cookbook-venv docs
	$(VENV)/bin/ruff check services tests docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25

# the generated reference is current, and the site builds with strict link checking (into build/site)
docs: install
	$(PY) docs/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# rewrite the generated reference pages (docs/reference/*.md) from the code
docs-gen: install
	$(PY) docs/gen_reference.py

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) tests/bench/run_benchmarks.py

lint: install
	$(VENV)/bin/ruff check services tests docs

clean:
	rm -rf runs checkpoints build
