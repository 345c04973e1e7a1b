"""The launcher's supervision loop without a whole run (services/launcher/processes.py and valkey.py,
docs/architecture.md §9): a service that dies once the run is winding down is not started again (the
coordinator still is); the embedded Valkey restarts in a thread of its own, so ``supervise`` returns at
once; engine restarts reported in the statuses are counted per agent, across a rollout's restart."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import redis

from services.common.embedded_redis import EmbeddedRedis
from services.contracts.streams import Streams
from services.launcher.processes import ProcessGroup, RestartBudget
from services.launcher.restarts import EngineRestarts, RestartLedger
from services.launcher.up import RedisProcess

FAIL = [sys.executable, "-c", "raise SystemExit(1)"]


def _group(tmp_path: Path) -> ProcessGroup:
    return ProcessGroup(tmp_path / "logs", {}, lambda name, line: None, RestartBudget(5, 60.0, first_delay_s=0.0))


def _exited(group: ProcessGroup) -> None:
    for c in group.children:
        c.proc.wait(30)


def test_only_the_coordinator_is_restarted_while_the_run_winds_down(tmp_path: Path) -> None:
    group = _group(tmp_path)
    group.start("trainer.A", FAIL)
    group.start("coordinator", FAIL)
    _exited(group)
    group.winding_down.set()
    notes = group.supervise()
    assert "trainer.A exited (code 1) while the run winds down: not restarted" in notes
    assert "coordinator restarted (restart 1)" in notes
    _exited(group)
    assert not any("trainer.A" in n for n in group.supervise(time.monotonic() + 1))  # noted once, never restarted
    assert group.restart_counts()["trainer.A"] == 0
    group.stop_all()


def test_a_dead_service_is_restarted_before_the_run_winds_down(tmp_path: Path) -> None:
    group = _group(tmp_path)
    group.start("trainer.A", FAIL)
    _exited(group)
    assert group.supervise() == ["trainer.A died (exit code 1); restarting it in 0.0s",
                                 "trainer.A restarted (restart 1)"]
    group.stop_all()


def test_valkey_restarts_without_blocking_the_loop(tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    try:
        redis.Redis.from_url(server.url).set("kept", "1")
        group = _group(tmp_path)
        valkey = RedisProcess("redis", server=server)
        group.others.append(valkey)
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait(10)
        started = time.monotonic()
        notes = group.supervise()
        assert time.monotonic() - started < 0.5 and notes[-1] == "redis restarted (restart 1)"
        valkey.join()
        time.sleep(1.0)  # still up after the restart (the thread that started it lives on: no parent-death signal)
        assert server.alive() and not valkey.failed()
        assert redis.Redis.from_url(server.url).get("kept") == b"1"  # on its AOF
    finally:
        server.stop()


def _status(**engines: list[int]) -> dict:
    return {"agents": {agent: {"rollout": {"engines": [{"url": f"http://e{i}", "restarts": n}
                                                       for i, n in enumerate(counts)]}}
                       for agent, counts in engines.items()}}


def test_engine_restarts_are_counted_per_agent_across_a_rollout_restart(redis_url: str) -> None:
    ledger = RestartLedger(redis_url, "engine-restarts")
    engines = EngineRestarts(ledger)
    for status in (_status(A=[0, 0], B=[0]), _status(A=[1, 0], B=[0]), _status(A=[1, 2], B=[0]),
                   _status(A=[1, 2], B=[0]), _status(A=[0, 1], B=[1])):  # A's rollout restarted: a new fleet
        engines.update(status)
    assert engines.total == {"engines.A": 4, "engines.B": 1}
    stored = ledger.client.hgetall(Streams("engine-restarts").restarts())
    assert {k.decode(): int(v) for k, v in stored.items()} == {"engines.A": 4, "engines.B": 1}
    assert ledger.counts(engines.total) == {"engines.A": 4, "engines.B": 1}
    ledger.client.close()


def test_router_restarts_are_counted_and_a_silent_engine_is_named(redis_url: str) -> None:
    """The fleet's router restarts reach ``state:restarts`` (and so summary.json) as ``router.<agent>``; an engine
    whose health checks hang past SILENT_NAMED_S is named in the live view."""
    from services.launcher.restarts import SILENT_NAMED_S, silent_engines
    from services.launcher.up import status_table

    ledger = RestartLedger(redis_url, "router-restarts")
    engines = EngineRestarts(ledger)
    for n in (0, 1, 1, 2, 0):  # then A's rollout restarted: a new fleet counts from 0
        status = _status(A=[0])
        status["agents"]["A"]["rollout"]["router_restarts"] = n
        engines.update(status)
    assert engines.total == {"router.A": 2}
    assert ledger.counts(engines.total) == {"router.A": 2}
    ledger.client.close()
    status = _status(A=[0, 0])
    status["agents"]["A"]["rollout"]["engines"][1]["silent_s"] = SILENT_NAMED_S + 2
    status["agents"]["A"]["rollout"]["engines"][0]["silent_s"] = 0.4
    assert silent_engines(status) == [f"engine http://e1 of A: no answer for {SILENT_NAMED_S + 2:.0f}s"]
    status["agents"]["A"].update(step=1, weight_version=1, recent_group_reward=None, eval_start=None, eval_end=None)
    full = {"run": "r", "phase": "training", "total_steps": 2, "episodes_per_s": 0.0, **status}
    assert "engine http://e1 of A: no answer" in str(status_table(full).caption)
