"""256 concurrent episodes through ``tandem up`` lose none (docs/architecture.md §10, §4; issue 16).

The demo's services (configs/demo.yaml) with A against B in every group (its opponent mix is taken out, so
both agents train on every group: tic-tac-toe, groups of 8, 16 groups a batch) with
``concurrent_episodes: 256`` and both agents at ``max_staleness: 1``, so that two steps' groups (32 x 8
= 256 episodes) may play at once. Checks: the run exits 0; more than 128 episodes were in flight at
some point (the status, polled); every launched group ends, per agent, kept, dropped or abandoned in
the ledger, with none missing and none abandoned; the summary's group counts add up to the groups
launched and its episode count to ``group_size`` per launched group, as does the episode store; and
the status said, while it ran, which gate held the next group.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from services.common.bus import Bus
from services.common.embedded_redis import free_port
from services.contracts.streams import Streams
from services.coordinator.ledger import GroupLedger
from tests.helpers import REPO, launch_up

pytestmark = pytest.mark.slow
RUN, STEPS, CONCURRENT = "many", 2, 256


def _config(tmp: Path, model: Path, redis_url: str, port: int) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["run"].update(name=RUN, total_steps=STEPS, concurrent_episodes=CONCURRENT,
                      checkpoint_root=str(tmp / "ckpt"), output_dir=str(tmp / "runs"))
    cfg["redis_url"], cfg["api"]["port"] = redis_url, port
    cfg["environment"]["eval"]["episodes"] = 0
    cfg["environment"].pop("matchups", None)  # A against B in every group: every group is in both ledgers
    for agent in cfg["agents"].values():
        agent.update(model_path=str(model), max_staleness=1, groups_per_batch=16)
    path = tmp / "many.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _watch(proc: Any, api: str, timeout: float) -> list[dict[str, Any]]:
    """Poll ``/v1/status`` until the run exits; every status seen."""
    seen, deadline = [], time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.append(httpx.get(f"{api}/v1/status", timeout=5).json())
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return seen


async def _ledger(redis_url: str) -> tuple[int, dict[str, dict[str, str]]]:
    bus = Bus(redis_url, RUN, service="test")
    try:
        ledger = GroupLedger(bus, ["A", "B"])
        outcomes = {a: {gid: o.state for gid, o in (await ledger.outcomes(a)).items()} for a in ("A", "B")}
        return await ledger.groups_launched(), outcomes
    finally:
        await bus.close()


def test_256_concurrent_episodes_lose_none(tmp_path: Path, warm_model_dir: Path, redis_url: str) -> None:
    port = free_port()
    cfg = _config(tmp_path, warm_model_dir, redis_url, port)
    with open(tmp_path / "launcher.log", "wb") as log:
        proc = launch_up(cfg, stdout=log)
        try:
            seen = _watch(proc, f"http://127.0.0.1:{port}", timeout=600)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    out = (tmp_path / "launcher.log").read_text(errors="replace")
    assert proc.returncode == 0, out[-3000:]
    in_flight = max(max(a["groups"]["in_flight"] for a in st["agents"].values()) for st in seen)
    assert in_flight * 8 > 128, f"at most {in_flight} groups played at once"
    assert all("gate" in a for st in seen for a in st["agents"].values())

    launched, outcomes = asyncio.run(_ledger(redis_url))
    summary = json.loads((tmp_path / "runs" / RUN / "summary.json").read_text())
    for agent, groups in outcomes.items():
        assert len(groups) == launched, f"{agent}: {launched} groups launched, {len(groups)} in the ledger"
        states = {s: sum(1 for v in groups.values() if v == s) for s in set(groups.values())}
        assert set(states) <= {"kept", "dropped"}, f"{agent}: {states}"  # none abandoned, none left open
        a = summary["agents"][agent]
        assert a["groups_kept"] + a["groups_dropped"] + a["groups_abandoned"] == launched, a
        assert (a["groups_kept"], a["groups_dropped"]) == (states.get("kept", 0), states.get("dropped", 0))
        assert a["steps"] == STEPS
    assert summary["episodes"] == launched * 8
    client = redis.Redis.from_url(redis_url)
    assert client.hlen(Streams(RUN).episodes()) == launched * 8
    client.close()
