"""A slow engine gets no duplicate turn: a turn still being generated is never reclaimed and generated again,
however far its generation runs past the bus's reclaim idle time; timeouts follow measured latency."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from services.common.bus import Bus
from services.common.latency import LatencyWindow
from services.contracts.messages import GenerateRequest, SamplingParams
from services.inference.generator import Engine, GenRequest

CLAIM_IDLE_MS = 300
STEP_DELAY_S = 0.12  # 10 tokens: a turn takes ~1.2 s, four times the reclaim idle time


async def test_a_slow_engine_gets_no_duplicate_turn(redis_url: str, tiny_model_dir: Path) -> None:
    """Two rollout consumers share the turns stream; a real engine made slow generates every turn once."""
    engine = Engine(tiny_model_dir, step_delay_s=STEP_DELAY_S)
    bus = Bus(redis_url, "slow", "rollout")
    stream = bus.streams.turns("A")
    generated: Counter[str] = Counter()
    took: list[float] = []

    async def on_turn(req: GenerateRequest) -> None:
        generated[req.id] += 1
        start = time.monotonic()
        await engine.generate(GenRequest(rid=req.id, input_ids=req.input_ids, max_new_tokens=10, ignore_eos=True,
                                         seed=req.sampling.seed))
        took.append(time.monotonic() - start)

    stop = asyncio.Event()
    await bus.ensure_group(stream, "rollout")
    ids = []
    for i in range(6):
        req = GenerateRequest(agent="A", episode_id=f"e{i}", group_id="g", turn=0, role="X", input_ids=[5 + i, 6, 7],
                              reply_stream=bus.streams.replies("test"),
                              sampling=SamplingParams(max_new_tokens=10, seed=i))
        await bus.publish(stream, req)
        ids.append(req.id)
    consumers = [asyncio.create_task(bus.consume(stream, "rollout", name, on_turn, stop, concurrency=3,
                                                 claim_idle_ms=CLAIM_IDLE_MS, block_ms=50))
                 for name in ("rollout-1", "rollout-2")]
    try:
        for _ in range(300):
            info = await bus.redis.xinfo_groups(stream)
            if len(took) == len(ids) and int(info[0]["pending"]) == 0:
                break
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*consumers)
        engine.stop()
        await bus.close()
    assert min(took) > 3 * CLAIM_IDLE_MS / 1000  # each turn ran well past the reclaim idle time
    assert generated == Counter(ids), f"turns generated more than once: {generated - Counter(ids)}"


def test_latency_window_bounds_follow_the_slowest_with_a_floor() -> None:
    w = LatencyWindow(size=3, factor=4.0)
    assert w.bound(30.0) == 30.0  # nothing measured: the configured floor
    for s in (1.0, 12.0, 2.0):
        w.add(s)
    assert w.bound(30.0) == 48.0 and w.bound(30.0, cap=40.0) == 40.0
    for s in (1.0, 1.0, 1.0):  # the slow one left the window
        w.add(s)
    assert w.bound(30.0) == 30.0
