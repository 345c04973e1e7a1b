"""Prometheus ``/metrics``: the coordinator's per-agent series and a service's own series on its health
port, scraped over real HTTP and parsed with prometheus_client's parser."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from services.common import service
from services.common.bus import Bus
from services.common.embedded_redis import free_port
from services.common.health import probe_server
from services.common.metrics import SERVICE_STARTS, record_start
from services.contracts.config import parse_config
from services.contracts.messages import Control, EngineStatus, RolloutLoad, TrainStep, WeightsLoaded
from services.coordinator.api import create_app
from services.coordinator.scheduler import Coordinator
from tests.helpers import commit_version


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, for every sample of the exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@contextlib.asynccontextmanager
async def serving(app: object) -> AsyncIterator[str]:
    port = free_port()
    server = probe_server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the API did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_coordinator_metrics_carry_the_per_agent_series(redis_url: str, tiny_model_dir: Path) -> None:
    cfg = parse_config({"run": {"name": "prom"}, "redis_url": redis_url,
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir), "max_staleness": 1},
                                   "B": {"model_path": str(tiny_model_dir)}}})
    bus = Bus(redis_url, "prom", "coordinator")
    coord = Coordinator(cfg, bus)
    step1 = {"train_seconds": 0.7, "tokens_per_s": 900.0, "reward_mean": 0.25, "stale_frac": 0.5}
    events = [
        TrainStep(source="trainer-A", agent="A", weight_version=1, batch_weight_version=1, metrics=step1),
        TrainStep(source="trainer-A", agent="A", weight_version=1, batch_weight_version=1, metrics=step1),  # re-sent
        TrainStep(source="trainer-A", agent="A", weight_version=2, batch_weight_version=2,
                  metrics={"train_seconds": 3.0, "tokens_per_s": 1000.0, "reward_mean": 0.5, "stale_frac": 0.0}),
        WeightsLoaded(source="rollout-A", agent="A", weight_version=2, path="/w/2", engines=[]),
        RolloutLoad(source="rollout-A", agent="A", queue_depth=7, inflight=3, capacity=8, waiting=0,
                    engines=[EngineStatus(url="http://e0", healthy=True, restarts=2)]),
    ]
    await commit_version(bus, "A", 1, metrics=step1)  # the owners' records the events announce
    await commit_version(bus, "A", 2, path="/w/2", metrics=events[2].metrics, loaded=True)
    for ev in events:
        await coord.events.on_event(ev)
    coord.state.agents["A"].group_rewards.extend([(0.0, 1.0), (1.0, 0.0)])
    coord.evals.append({"label": "start", "scores": {"A": 0.25, "B": None}})
    coord.episodes["e1"] = {"turns": [{"agent": "A", "tokens": 30}, {"agent": "B", "tokens": 5},
                                      {"agent": "scripted:random"}]}
    await bus.redis.xadd(bus.streams.deadletter, bus.letter(bus.streams.samples("A"), "1-0", b"x", "invalid Sample"))
    await bus.redis.xadd(bus.streams.deadletter, bus.letter(bus.streams.events, "2-0", b"y", "invalid Event"))
    starts = bus.streams.key(SERVICE_STARTS)
    for svc in ("trainer-A", "trainer-A", "trainer-A", "buffer-B", "coordinator"):
        await record_start(bus.redis, starts, svc)

    async with serving(create_app(coord)) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        resp = await client.get("/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        got = samples(resp.text)
        coord.episodes["e2"] = {"turns": [{"agent": "A", "tokens": 10}]}
        again = samples((await client.get("/metrics")).text)  # each record's tokens count once
        openmetrics = await client.get("/metrics", headers={"accept": "application/openmetrics-text"})
        assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
        assert openmetrics.text.rstrip().endswith("# EOF")

    a, b = (("agent", "A"),), (("agent", "B"),)
    assert got[("tandem_weight_version", a)] == 2 and got[("tandem_weight_version", b)] == 0
    assert got[("tandem_train_steps_total", a)] == 2 and got[("tandem_train_steps_total", b)] == 0
    assert got[("tandem_train_reward", a)] == 0.5 and got[("tandem_group_reward", a)] == 0.5
    assert ("tandem_group_reward", b) not in got  # no group yet: no value rather than a made-up 0
    assert got[("tandem_eval_score", (("agent", "A"), ("label", "start")))] == 0.25
    assert got[("tandem_queue_depth", a)] == 7 and got[("tandem_inflight_turns", a)] == 3
    assert got[("tandem_inflight_capacity", a)] == 8
    assert got[("tandem_staleness", a)] == 0 and got[("tandem_max_staleness", a)] == 1
    assert got[("tandem_train_stale_fraction", a)] == 0.0 and got[("tandem_train_tokens_per_second", a)] == 1000
    assert got[("tandem_train_step_seconds_count", a)] == 2 and got[("tandem_train_step_seconds_sum", a)] == 3.7
    assert got[("tandem_train_step_seconds_bucket", (("agent", "A"), ("le", "1.0")))] == 1
    assert got[("tandem_train_step_seconds_bucket", (("agent", "A"), ("le", "+Inf")))] == 2
    assert got[("tandem_generated_tokens_total", a)] == 30 and got[("tandem_generated_tokens_total", b)] == 5
    assert again[("tandem_generated_tokens_total", a)] == 40
    assert again[("tandem_generation_tokens_per_second", a)] > 0
    assert got[("tandem_dead_letters_total", a)] == 1 and got[("tandem_dead_letters_total", (("agent", ""),))] == 1
    assert again[("tandem_dead_letters_total", a)] == 1  # read once, not again at the next scrape
    assert got[("tandem_restarts_total", (("agent", "A"), ("service", "engine http://e0")))] == 2
    assert got[("tandem_restarts_total", (("agent", "A"), ("service", "trainer-A")))] == 2
    assert got[("tandem_restarts_total", (("agent", "B"), ("service", "buffer-B")))] == 0
    assert got[("tandem_restarts_total", (("agent", ""), ("service", "coordinator")))] == 0
    assert got[("tandem_episodes_total", ())] == 0 and got[("tandem_phase", (("phase", "starting"),))] == 1
    await bus.close()


async def test_a_service_serves_its_own_metrics_on_the_health_port(redis_url: str) -> None:
    bus = Bus(redis_url, "prom-svc", "svc-A")
    stop = asyncio.Event()
    stream = bus.streams.control  # a stream of the flow table: the Bus validates its entries as Control
    handled = asyncio.Event()

    async def on_ping(msg: Control) -> None:
        if msg.command == "resume":
            handled.set()

    await bus.redis.xadd(stream, {b"m": b"not a command"})  # no payload field: dead-lettered
    port = free_port()
    runner = asyncio.create_task(service.run_service(
        "svc.A", bus, stop, bus.consume(stream, "control-buffer-A", "svc-A", on_ping, stop), health_port=port))
    publisher = Bus(redis_url, "prom-svc", "publisher")
    for command in ("pause", "resume"):
        await publisher.publish(stream, Control(command=command))
    await asyncio.wait_for(handled.wait(), 10)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        resp = await client.get("/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        assert (await client.post("/metrics")).status_code == 405
    got = samples(resp.text)
    assert got[("tandem_bus_dead_letters_total", (("stream", stream),))] == 1
    ok = (("group", "control-buffer-A"), ("outcome", "ok"), ("stream", stream))
    assert got[("tandem_bus_handled_seconds_count", ok)] == 2  # both commands (the malformed entry is dead-lettered
    # as it is read, before any handler: counted in tandem_bus_dead_letters_total above)
    assert got[("tandem_bus_handled_seconds_sum", ok)] > 0
    assert got[("process_cpu_seconds_total", ())] > 0 and got[("process_resident_memory_bytes", ())] > 0
    stop.set()
    await asyncio.wait_for(runner, 10)
    await publisher.close()
