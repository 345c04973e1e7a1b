"""Schemathesis over the control API's live OpenAPI document (docs/architecture.md §6).

The real coordinator API (a Coordinator on the real Redis, with real episodes of the tiny model) is served by
uvicorn on a port of its own, and schemathesis generates requests for every operation the document lists,
twice: with the configured ``api.token`` and without it. Its checks are on: no server error, every status
documented, every body and content type as documented (``response_schema_conformance`` validates each 4xx
body against the published error schema, services/coordinator/errors.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import hypothesis
import pytest
import schemathesis
import uvicorn
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.common.bus import Bus
from services.common.embedded_redis import free_port
from services.contracts.config import parse_config
from services.contracts.players import Local, Scripted
from services.coordinator.api import create_app
from services.coordinator.scheduler import Coordinator
from services.envs.tictactoe import TicTacToe

TOKEN = "schema-token"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
EXAMPLES = 15  # per operation and pass: 2 x 15 x ~16 operations stays well under a minute


@contextmanager
def live_api(redis_url: str, model: Path) -> Iterator[str]:
    """The coordinator API over real episodes, served by uvicorn on its own event loop (in a thread, so the
    synchronous schemathesis calls never block it)."""
    port, started, box = free_port(), threading.Event(), {}

    async def serve() -> None:
        cfg = parse_config({"run": {"name": "schema"}, "redis_url": redis_url, "api": {"token": TOKEN},
                            "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
                            "agents": {a: {"model_path": str(model), "sampling": {"max_new_tokens": 4}}
                                       for a in ("A", "B")}})
        coord = Coordinator(cfg, Bus(redis_url, "schema", "coordinator"))
        roles = {"X": Local(path=str(model), agent="A"), "O": Scripted(name="random")}
        for i in range(2):
            await coord.episode_log.play(TicTacToe({}, i), f"g{i}", roles, "train", coord.players.sampling_for(roles))
        server = box["server"] = uvicorn.Server(uvicorn.Config(create_app(coord), host="127.0.0.1", port=port,
                                                               log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn sets a flag, not an event)
            await asyncio.sleep(0.02)
        started.set()
        await task
        await coord.bus.close()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(180), "the API did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        box["server"].should_exit = True
        thread.join(30)


def run_operations(url: str, headers: dict[str, str]) -> list[str]:
    """Every operation of the live document through schemathesis with ``CHECKS``; the labels exercised."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    labels = []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)

        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=url, headers=headers, checks=CHECKS, timeout=30)

        check()
    return labels


@pytest.mark.slow
def test_the_live_openapi_holds_for_every_operation(redis_url: str, tiny_model_dir: Path) -> None:
    with live_api(redis_url, tiny_model_dir) as url:
        labels = run_operations(url, {"Authorization": f"Bearer {TOKEN}"})
        assert {"GET /v1/status", "GET /v1/episodes/{episode_id}", "POST /v1/pause",
                "GET /v1/dashboard/episodes/{episode_id}/tokens", "GET /metrics"} <= set(labels)
        run_operations(url, {})  # no token: every guarded route answers its documented 401
