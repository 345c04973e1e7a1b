"""Shared fixtures: a real Redis-protocol server (embedded Valkey) on a free port.

The suite never touches a Redis that may already run on 6379.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.common.embedded_redis import EmbeddedRedis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


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


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small warm-started demo model (legal tic-tac-toe moves), made once per session."""
    from services.demo.warmstart import warmstart

    return Path(warmstart(tmp_path_factory.mktemp("warm") / "model", seed=0, games=600, epochs=4))
