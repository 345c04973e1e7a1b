"""A trainer's per-step metrics reach ``/v1/metrics`` once per version, re-sends after a crash included."""

from __future__ import annotations

from pathlib import Path

import httpx

from services.common.bus import Bus
from services.contracts.config import parse_config
from services.contracts.messages import TrainStep
from services.coordinator.api import create_app
from services.coordinator.scheduler import Coordinator
from tests.helpers import commit_version


async def test_train_step_metrics_are_served_once_per_version(redis_url: str, tiny_model_dir: Path) -> None:
    cfg = parse_config({"run": {"name": "metrics"}, "redis_url": redis_url,
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir)}}})
    bus = Bus(redis_url, "metrics", "coordinator")
    coord = Coordinator(cfg, bus)
    step = {"loss": 0.5, "pg_loss": 0.4, "kl": 0.01, "kl_loss": 0.1, "entropy": 2.0, "entropy_loss": -0.0,
            "clip_frac": 0.1, "grad_norm": 0.7, "tis_ratio_mean": 1.1, "tis_ratio_max": 2.5, "tokens_per_s": 900.0}
    for version in (1, 2):  # the trainer's commits: the metrics the coordinator takes (an event only notifies)
        await commit_version(bus, "A", version, metrics=step)
    for version in (1, 1, 2):  # version 1 re-announced after a trainer restart
        await coord.events.on_event(TrainStep(source="trainer-A", agent="A", weight_version=version,
                                              batch_weight_version=version, metrics=step))
    transport = httpx.ASGITransport(app=create_app(coord))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        got = (await client.get("/v1/metrics", params={"agent": "A"})).json()["A"]["train_steps"]
    assert [s["weight_version"] for s in got] == [1, 2]
    assert {k: got[0][k] for k in step} == step
    await bus.close()
