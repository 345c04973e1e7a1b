"""The rollout owns its router and engines: command lines (SGLang checked against its own flags),
config, and the kill-an-engine run (real rollout process, real sglang-router, real engines, real Redis).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from safetensors.torch import load_file, save_file

from services.common.bus import Bus
from services.common.sglang_router import list_workers
from services.contracts.config import AgentConfig, ConfigError, parse_config
from services.contracts.messages import (
    EngineStatus,
    GenerateReply,
    GenerateRequest,
    RolloutLoad,
    SamplingParams,
    WeightsLoaded,
)
from services.rollout.commands import engine_command
from services.rollout.engine_client import EngineClient
from services.rollout.fleet import EngineFleet
from services.rollout.service import resume_weights
from tests.helpers import read_all, signed_proof
from tests.trainer_commit import commit_weights

REPO = Path(__file__).resolve().parents[2]


def _sglang_flags() -> set[str]:
    """Every ``--flag`` SGLang 0.5.23's launch_server accepts: its ServerArgs field namespaces
    (``arg_groups/fields/*.py``, one ``--name-with-dashes`` per field) plus the hand-registered ones."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    srt = Path(next(iter(spec.submodule_search_locations))) / "srt"
    flags: set[str] = set()
    for f in (srt / "arg_groups" / "fields").glob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ClassDef):
                flags |= {"--" + a.target.id.replace("_", "-") for a in n.body
                          if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
    flags |= {c.value for c in ast.walk(ast.parse((srt / "server_args.py").read_text()))
              if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.startswith("--")}
    return flags


def test_sglang_engine_commands() -> None:
    acfg = AgentConfig(model_path="/models/qwen", engine="sglang", num_engines=2,
                       sglang={"tp_size": 2, "mem_fraction_static": 0.7, "base_gpu_id": 1,
                               "extra_args": ["--context-length", "4096"]})
    cmds = [engine_command(acfg, "A", i, 30000 + i, host="0.0.0.0") for i in range(2)]
    assert cmds[0][1:] == ["-m", "sglang.launch_server", "--model-path", "/models/qwen", "--host", "0.0.0.0",
                           "--port", "30000", "--tp-size", "2", "--mem-fraction-static", "0.7",
                           "--base-gpu-id", "1", "--context-length", "4096"]
    assert cmds[1][cmds[1].index("--base-gpu-id") + 1] == "3"  # engine 1: GPUs 3, 4
    assert cmds[1][cmds[1].index("--port") + 1] == "30001"
    flags = _sglang_flags()
    for cmd in cmds:
        used = {a for a in cmd if a.startswith("--")}
        assert used <= flags, used - flags
    embedded = engine_command(AgentConfig(model_path="m", max_inflight_per_engine=8), "B", 0, 9000)
    assert embedded[1:] == ["-m", "services.engine", "--model-path", "m", "--host", "127.0.0.1", "--port", "9000",
                            "--engine-id", "B-0", "--agent", "B", "--max-batch", "8", "--device", "cpu",
                            "--dtype", "float32", "--prefix-cache-mb", "256.0"]


def test_config_fields_of_the_lifecycle() -> None:
    base = {"run": {"name": "x"}, "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}}}
    cfg = parse_config({**base, "agents": {"A": {"model_path": "m"}}})
    a = cfg.agents["A"]
    assert (a.router_port, a.engine_base_port, a.sglang.tp_size, a.sglang.mem_fraction_static,
            a.sglang.base_gpu_id, a.sglang.extra_args) == (0, 0, 1, 0.85, 0, [])
    for bad, field in (({"sglang": {"tp_size": 0}}, "sglang.tp_size"), ({"router_port": 70000}, "router_port"),
                       ({"sglang": {"mem_fraction_static": 1.5}}, "mem_fraction_static"),
                       ({"sglang": {"gpus": 2}}, "sglang.gpus")):
        with pytest.raises(ConfigError, match=field):
            parse_config({**base, "agents": {"A": {"model_path": "m", **bad}}})


async def _events(bus: Bus, kind: str) -> list[WeightsLoaded | RolloutLoad]:
    return [e for e in await read_all(bus, bus.streams.events) if e.kind == kind]


@pytest.mark.slow
def test_kill_an_engine_mid_run(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    cfg = {"run": {"name": "fleet", "checkpoint_root": str(tmp_path / "ck"), "output_dir": str(tmp_path / "runs")},
           "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
           "agents": {"A": {"model_path": str(tiny_model_dir), "num_engines": 2, "max_inflight_per_engine": 4}}}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    v1 = tmp_path / "v1"
    shutil.copytree(tiny_model_dir, v1)
    for f in v1.glob("*.safetensors"):
        save_file({k: v * 1.01 for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    env = {**os.environ, "TANDEM_REDIS_URL": redis_url, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    log = (tmp_path / "rollout.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.rollout", "--config", str(path), "--agent", "A"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(_drive(proc, redis_url, v1, tmp_path / "rollout.log"))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def _drive(proc: subprocess.Popen[bytes], redis_url: str, v1: Path, log_path: Path) -> None:
    """Load v1, send turns, kill -9 one of the two engines while they run, check nothing is lost."""
    bus = Bus(redis_url, "fleet", "test")
    s = bus.streams
    replies: dict[str, GenerateReply] = {}

    async def send(n: int, tag: str) -> list[str]:
        ids = []
        for i in range(n):
            req = GenerateRequest(agent="A", episode_id=f"{tag}{i}", group_id="g", turn=0, role="X",
                                  input_ids=[5 + i % 50, 6, 7], reply_stream=s.replies("test"),
                                  sampling=SamplingParams(max_new_tokens=24, temperature=1.0, seed=i))
            await bus.publish(s.turns("A"), req)
            ids.append(req.id)
            await asyncio.sleep(0.05)
        return ids

    async def collect(ids: list[str], within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and not set(ids) <= set(replies):
            for r in await read_all(bus, s.replies("test")):
                replies[r.request_id] = r
            await asyncio.sleep(0.3)

    async def load() -> dict[str, Any]:
        ev = await _events(bus, "rollout_load")
        return ev[-1].report() if ev else {}

    try:
        for _ in range(600):  # both engines registered
            assert proc.poll() is None, f"the rollout exited; see {log_path}"
            if sum(e["healthy"] for e in (await load()).get("engines", [])) == 2:
                break
            await asyncio.sleep(0.2)
        await bus.publish(s.weights("A"), await commit_weights(bus, "A", 1, v1))
        for _ in range(300):  # turns race the update on the engines: send them once version 1 is loaded
            if await _events(bus, "weights_loaded"):
                break
            await asyncio.sleep(0.1)
        first = await send(10, "a")
        await collect(first, 60)
        assert len(await _events(bus, "weights_loaded")) == 1
        engines = (await load())["engines"]
        victim = engines[1]
        more = asyncio.create_task(send(30, "b"))
        await asyncio.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)  # mid-run, requests in flight
        second = await more
        await collect(first + second, 90)
        assert set(first + second) <= set(replies), f"lost {len(set(first + second) - set(replies))} turn(s)"
        for rid in first + second:
            r = replies[rid]
            assert r.error is None and r.finish_reason in ("stop", "length") and r.weight_version == 1
            assert len(r.output_ids) == len(r.output_logprobs) > 0
        for _ in range(300):  # the engine comes back, on version 1, registered again
            back = next(e for e in (await load())["engines"] if e["url"] == victim["url"])
            if back["healthy"] and back["restarts"] == 1:
                break
            await asyncio.sleep(0.2)
        assert back["healthy"] and back["restarts"] == 1 and back["pid"] != victim["pid"]
        async with httpx.AsyncClient(timeout=5) as http:
            info = (await http.get(f"{victim['url']}/get_model_info")).json()
        assert info["weight_version"] == "1"  # the latest version was re-applied before it rejoined
        third = await send(8, "c")
        await collect(third, 60)
        assert {replies[r].engine for r in third} == {"A-0", "A-1"}  # traffic reaches it again
        assert (await load())["capacity"] == 8
        # an older version arriving late (a redelivered update) never rolls the engines back
        signed = {v: await commit_weights(bus, "A", v, v1) for v in (2, 3)}
        for version in (3, 2):
            await bus.publish(s.weights("A"), signed[version])
        for _ in range(300):
            groups = await bus.redis.xinfo_groups(s.weights("A"))
            if all(int(g.get("lag") or 0) == 0 and int(g.get("pending") or 0) == 0 for g in groups):
                break
            await asyncio.sleep(0.1)
        assert [e.weight_version for e in await _events(bus, "weights_loaded")] == [1, 3]
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"{victim['url']}/get_model_info")).json()["weight_version"] == "3"
    finally:
        await bus.close()


@pytest.mark.slow
async def test_a_hung_engine_is_restarted(tiny_model_dir: Path, redis_url: str) -> None:
    """SIGSTOP an engine: /health_generate stops answering, the fleet deregisters, kills and restarts it.
    Then a (re)started rollout puts the fleet on the version the agent had loaded (``resume_weights``)."""
    fleet = EngineFleet("A", AgentConfig(model_path=str(tiny_model_dir), num_engines=1), interval=0.5,
                        health_timeout=1.0, max_failures=2)
    stop = asyncio.Event()
    try:
        await fleet.start()
        watcher = asyncio.create_task(fleet.supervise(stop))
        engine = fleet.engines[0]
        assert await list_workers(fleet.router_url, token=fleet.token) == [engine.url]
        old = engine.proc.pid if engine.proc else 0
        os.kill(old, signal.SIGSTOP)
        stopped, named_s = time.monotonic(), None
        for _ in range(600):
            if engine.restarts == 1 and engine.registered:
                break
            if named_s is None and engine.restarts == 0 and fleet.snapshot()[0]["silent_s"] >= 1.0:
                named_s = time.monotonic() - stopped  # what the status shows of it (silent_s), before its restart
            await asyncio.sleep(0.1)
        assert named_s is not None and named_s < 5, named_s
        assert engine.restarts == 1 and engine.registered and engine.proc and engine.proc.pid != old
        assert await list_workers(fleet.router_url, healthy_only=True, token=fleet.token) == [engine.url]
        async with EngineClient(fleet.router_url, timeout=30, token=fleet.token) as client:
            res = await client.generate([5, 6], {"max_new_tokens": 3}, rid="after-hang")
        assert len(res.output_ids) == 3 or res.finish_reason == "stop"
        stop.set()
        await watcher
        bus = Bus(redis_url, "hung", "test")
        try:
            await commit_weights(bus, "A", 1, tiny_model_dir)
            w = await commit_weights(bus, "A", 2, tiny_model_dir)
            await bus.redis.set(bus.streams.loaded_weights("A"), w.model_dump_json())
            await resume_weights(bus, "A", fleet)
        finally:
            await bus.close()
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"{engine.url}/get_model_info")).json()["weight_version"] == "2"
        assert fleet.latest == (str(tiny_model_dir), 2)
    finally:
        stop.set()
        await fleet.close()


@pytest.mark.slow
async def test_a_router_whose_metrics_port_was_taken_is_started_again(tiny_model_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's metrics port is picked free, then bound by the router: another process can take it in
    between (seen once in a three-agent run). The real router then exits at once; the fleet starts it again
    with another port instead of waiting a minute for a dead process and failing the rollout."""
    import socket

    import services.common.sglang_router as sglang_router

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    first = [taken.getsockname()[1]]
    real_free_port = sglang_router.free_port
    monkeypatch.setattr(sglang_router, "free_port", lambda: first.pop() if first else real_free_port())
    fleet = EngineFleet("A", AgentConfig(model_path=str(tiny_model_dir), num_engines=1), interval=0.3)
    try:
        started = time.monotonic()
        await fleet.start()
        assert time.monotonic() - started < 45 and fleet.router and fleet.router.returncode is None
        assert await list_workers(fleet.router_url, healthy_only=True, token=fleet.token) == [fleet.engines[0].url]
    finally:
        taken.close()
        await fleet.close()


async def test_a_dead_router_is_restarted_and_gets_its_engines_back(tiny_model_dir: Path) -> None:
    """SIGKILL the real sglang-router: the fleet starts it again on its port, registers both live engines
    with it on the version the fleet had loaded, and generation through it works again."""
    fleet = EngineFleet("A", AgentConfig(model_path=str(tiny_model_dir), num_engines=2), interval=0.3)
    stop = asyncio.Event()
    try:
        await fleet.start()
        await fleet.load_weights(str(tiny_model_dir), 4, proof=signed_proof(tiny_model_dir, "A", 4))
        watcher = asyncio.create_task(fleet.supervise(stop))
        urls = sorted(e.url for e in fleet.engines)
        assert sorted(await list_workers(fleet.router_url, token=fleet.token)) == urls
        old = fleet.router.pid if fleet.router else 0
        engine_pids = [e.proc.pid for e in fleet.engines if e.proc]
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        for _ in range(600):
            if fleet.router_restarts == 1 and fleet.healthy() == 2:
                break
            assert not watcher.done(), watcher.exception() if watcher.done() else ""
            await asyncio.sleep(0.1)
        back_s = time.monotonic() - killed
        assert fleet.router_restarts == 1 and fleet.healthy() == 2, fleet.snapshot()
        assert fleet.router and fleet.router.pid != old and fleet.router.returncode is None
        assert sorted(await list_workers(fleet.router_url, healthy_only=True, token=fleet.token)) == urls
        assert [e.proc.pid for e in fleet.engines if e.proc] == engine_pids  # the engines were kept
        assert [e.weight_version for e in fleet.engines] == [4, 4]
        async with EngineClient(fleet.router_url, timeout=30, token=fleet.token) as client:
            res = await client.generate([5, 6], {"max_new_tokens": 3}, rid="after-router-restart")
        assert res.weight_version == 4 and (len(res.output_ids) == 3 or res.finish_reason == "stop")
        logging.getLogger("test").info("router back with its engines %.1fs after SIGKILL", back_s)
        stop.set()
        await watcher
    finally:
        stop.set()
        await fleet.close()


@pytest.mark.slow
async def test_an_engine_killed_under_a_weights_update_gets_the_version_when_it_rejoins(tiny_model_dir: Path) -> None:
    """SIGKILL the only engine as a weights update reaches it: the update does not fail (its redelivery would
    wait for the bus's reclaim, stalling an on-policy agent); it returns once the restarted engine rejoined on
    that version (found by the fault-injection test, issue 11)."""
    fleet = EngineFleet("A", AgentConfig(model_path=str(tiny_model_dir), num_engines=1), interval=0.3)
    stop = asyncio.Event()
    try:
        await fleet.start()
        watcher = asyncio.create_task(fleet.supervise(stop))
        engine = fleet.engines[0]
        assert engine.proc is not None
        os.kill(engine.proc.pid, signal.SIGKILL)  # the update's POST then breaks, or finds no engine
        assert await fleet.load_weights(str(tiny_model_dir), 3, rejoin_timeout=300,
                                        proof=signed_proof(tiny_model_dir, "A", 3)) == [engine.url]
        assert fleet.latest == (str(tiny_model_dir), 3) and engine.restarts == 1 and engine.weight_version == 3
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"{engine.url}/get_model_info")).json()["weight_version"] == "3"
        stop.set()
        await watcher
    finally:
        stop.set()
        await fleet.close()


async def test_rollout_load_shows_in_status(tiny_model_dir: Path, redis_url: str) -> None:
    from services.coordinator.scheduler import Coordinator

    cfg = parse_config({"run": {"name": "st"}, "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir)}}})
    bus = Bus(redis_url, "st", "test")
    try:
        coord = Coordinator(cfg, bus)
        data = {"queue_depth": 3, "inflight": 2, "capacity": 64, "waiting": 0, "router": "http://r",
                "router_restarts": 0,
                "engines": [{"url": "http://e0", "healthy": True, "restarts": 1, "num_reqs": 2}]}
        await coord.events.on_event(RolloutLoad(source="rollout-A", agent="A", **data))
        assert coord.state.status()["agents"]["A"]["rollout"] == data
    finally:
        await bus.close()


async def test_coordinator_sends_no_turn_before_every_rollout_has_a_healthy_engine(tiny_model_dir: Path,
                                                                                   redis_url: str) -> None:
    from services.coordinator.scheduler import Coordinator

    m = str(tiny_model_dir)
    cfg = parse_config({"run": {"name": "ready"},
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
                        "agents": {"A": {"model_path": m}, "B": {"model_path": m, "train": False}}})
    bus = Bus(redis_url, "ready", "test")
    try:
        coord = Coordinator(cfg, bus)
        waiting = asyncio.create_task(coord.events.wait_for_engines(timeout=60))

        async def load(agent: str, healthy: bool) -> None:
            await coord.events.on_event(RolloutLoad(source=f"rollout-{agent}", agent=agent,
                                                    engines=[EngineStatus(url="http://e0", healthy=healthy)]))
            await asyncio.sleep(0.05)

        await load("A", True)
        await load("B", False)  # B (frozen) is still starting its engine
        assert not waiting.done() and coord.state.phase == "starting"
        await load("B", True)
        await asyncio.wait_for(waiting, 5)
        assert coord.events.engines_ready == {"A", "B"}
    finally:
        await bus.close()
