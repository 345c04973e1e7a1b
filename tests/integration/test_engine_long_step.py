"""An engine inside one long step (a real model's prefill of a full batch on a loaded CPU) is healthy: its
``/health_generate`` answers 200 at once instead of queueing a generation behind the step, so the rollout's
fleet does not restart a busy engine mid-batch. A step running past ``STEP_STALL_S`` is no longer trusted."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.engine.server import STEP_STALL_S
from tests.helpers import asgi_client, engine_app


async def test_a_long_step_is_progress_and_a_stalled_one_is_not(tiny_model_dir: Path) -> None:
    release = threading.Event()
    with engine_app(tiny_model_dir, weight_version=0, max_batch=8, engine_id="slow") as app:
        engine = app.state.engine
        prefill = engine._prefill

        def slow_prefill(reqs):  # the model thread stays inside this step until released
            release.wait(timeout=60)
            return prefill(reqs)

        engine._prefill = slow_prefill
        async with asgi_client(app, base_url="http://engine", http_timeout_s=60.0) as client:
            gen = asyncio.create_task(client.post("/generate", json={
                "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}))
            for _ in range(200):
                if engine.step_started_at is not None:
                    break
                await asyncio.sleep(0.02)
            assert engine.step_started_at is not None, "the step never started"
            engine.last_step_at = time.monotonic() - 60  # no step has ended for a minute
            started = time.monotonic()
            assert (await client.get("/health_generate")).status_code == 200
            assert time.monotonic() - started < 2.0
            engine.step_started_at -= STEP_STALL_S + 1  # the same step, now past the stall limit
            with pytest.raises((TimeoutError, httpx.TimeoutException)):
                await asyncio.wait_for(client.get("/health_generate"), timeout=1.0)  # it queues a generation
            release.set()
            reply = await gen
            assert reply.status_code == 200 and reply.json()["output_ids"]
