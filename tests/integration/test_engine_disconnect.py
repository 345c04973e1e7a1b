"""A ``/generate`` whose caller gives up is aborted on the engine: its requests leave at once and free their
slots, so a caller's timeout-and-retry does not pile copies of the same work onto a busy engine. The engine
aborts a call whose HTTP client disconnects; the rollout's client also aborts a timed-out call's requests."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from services.common.embedded_redis import free_port
from services.contracts.agent_parts import EmbeddedConfig
from services.contracts.config import AgentConfig
from services.rollout.commands import engine_command
from services.rollout.engine_client import EngineClient, EngineClientError
from services.rollout.spawn import spawn
from tests.helpers import ADMIN_TOKEN, wait_until

STEP_DELAY_MS = 50  # 2000 tokens would take 100 s: only an abort empties the engine within seconds
LONG = {"max_new_tokens": 2000, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[str]:
    """A real engine process (the rollout's command line) on the tiny model, made slow; its URL."""
    acfg = AgentConfig(model_path=str(tiny_model_dir), max_inflight_per_engine=8,
                       embedded=EmbeddedConfig(step_delay_ms=STEP_DELAY_MS, prefix_cache_mb=0))
    port = free_port()
    proc = spawn(engine_command(acfg, "A", 0, port), ADMIN_TOKEN)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 180, "the engine up",
                   proc=proc.popen)
        yield url
    finally:
        proc.terminate()
        try:
            proc.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:  # uvicorn waits for requests still open
            proc.kill()
            proc.popen.wait(timeout=15)


async def _load(client: httpx.AsyncClient) -> dict[str, int]:
    return (await client.get("/get_load")).json()[0]


async def _poll(client: httpx.AsyncClient, done: Callable[[dict[str, int]], bool],
                within: float = 10) -> dict[str, int]:
    """The engine's load once ``done`` holds for it, or after ``within`` seconds."""
    deadline = time.monotonic() + within
    load = await _load(client)
    for _ in range(int(within / 0.05)):
        if done(load) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
        load = await _load(client)
    return load


async def _client_aborts(client: httpx.AsyncClient) -> int:
    return int((await client.get("/get_server_info")).json()["internal_states"][0]["client_aborts"])


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
async def test_a_disconnected_generate_is_aborted(engine: str, batch: bool) -> None:
    async with httpx.AsyncClient(base_url=engine, timeout=30) as client:
        before = await _client_aborts(client)
        prompts = [[5, 6, 7], [8, 9, 10, 11]] if batch else [5, 6, 7]
        body = {"input_ids": prompts, "rid": f"long-{batch}", "sampling_params": LONG}
        call = asyncio.create_task(client.post("/generate", json=body, timeout=1.5))
        running = await _poll(client, lambda load: load["num_reqs"] > 0)
        assert running["num_reqs"] == (len(prompts) if batch else 1)  # generating, well before the timeout
        with pytest.raises(httpx.ReadTimeout):  # the caller gives up, as the rollout does after its timeout
            await call
        gone = time.monotonic()
        load = await _poll(client, lambda load: load["num_reqs"] == 0)
        took = time.monotonic() - gone
        assert load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0, f"still held after {took:.1f} s: {load}"
        assert took < 4.0  # at once, not when 2000 tokens are done (SGLang's own check runs every 4 s)
        assert await _client_aborts(client) - before == (2 if batch else 1)
        short = await client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 3, "ignore_eos": True}})
        assert short.status_code == 200 and len(short.json()["output_ids"]) == 3
        assert (await _load(client))["num_reqs"] == 0


async def test_the_rollout_aborts_a_timed_out_calls_requests(engine: str, caplog: pytest.LogCaptureFixture) -> None:
    """The rollout's client, on a timeout, sends ``/abort_request`` for the call's rids to every engine; those
    rids are the engine's (``{rid}_{i}`` in a batch), so an abort frees exactly the call's requests."""

    async def engines() -> list[str]:
        return [engine]

    async with EngineClient(engine, timeout=1.0, token=ADMIN_TOKEN, engines=engines) as rollout, \
            httpx.AsyncClient(base_url=engine, timeout=60) as client:
        with caplog.at_level(logging.WARNING, "tandem.rollout"), pytest.raises(EngineClientError, match="Timeout"):
            await rollout.generate_batch([[5, 6, 7], [8, 9]], LONG, rid="late")
        assert "generate late timed out: aborted" in caplog.text and "of its 2 request(s) on 1 engine(s)" in caplog.text
        assert (await _poll(client, lambda load: load["num_reqs"] == 0))["num_reqs"] == 0

        # a call still connected: only the abort ends it, with SGLang's abort finish reason
        call = asyncio.create_task(client.post("/generate", json={"input_ids": [[5, 6], [7, 8]], "rid": "held",
                                                                   "sampling_params": LONG}))
        assert (await _poll(client, lambda load: load["num_reqs"] == 2))["num_reqs"] == 2
        assert await rollout.abort(["held_0", "held_1"], why="test") == 2
        replies = (await asyncio.wait_for(call, 10)).json()
        assert [r["meta_info"]["finish_reason"]["type"] for r in replies] == ["abort", "abort"]
        assert all(len(r["output_ids"]) < 2000 for r in replies)
        assert (await _load(client))["num_reqs"] == 0
