"""The services' ``GET /health`` endpoint (container HEALTHCHECK and Kubernetes probes):
a real buffer process, and ``run_service`` in-process for the stopping (503) window."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.common import health as health_mod
from services.common import service
from services.common.bus import Bus
from services.common.embedded_redis import free_port
from tests.helpers import first_response

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, redis_url: str) -> Path:
    cfg = {"run": {"name": "health", "checkpoint_root": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "runs")},
           "redis_url": redis_url,
           "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
           "agents": {"A": {"model_path": str(tmp_path / "model")}}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _wait_health(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"service exited with {proc.returncode}: {proc.stderr.read()}"
        try:
            return httpx.get(url, timeout=2.0)
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"no answer from {url} within {timeout}s")


def test_buffer_process_serves_health_from_the_env_port(tmp_path, redis_url):
    port = free_port()
    env = {**os.environ, "TANDEM_HEALTH_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "services.buffer", "--config", str(_config(tmp_path, redis_url)),
                             "--agent", "A"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}/health"
        resp = _wait_health(url, proc)
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
        body = resp.json()
        assert body["service"] == "buffer.A" and body["ok"] is True
        assert httpx.head(url).status_code == 200
        miss = httpx.get(f"http://127.0.0.1:{port}/nope")
        assert miss.status_code == 404 and "/health" in miss.json()["error"]
        post = httpx.post(url)
        assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
        with socket.create_connection(("127.0.0.1", port)) as s:  # not HTTP at all
            s.sendall(b"hello\r\n\r\n")
            assert s.recv(200).startswith(b"HTTP/1.1 400 ")
        assert health_mod.main([url]) == 0  # the HEALTHCHECK command
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics")  # the process's own Prometheus registry
        assert metrics.status_code == 200 and "process_resident_memory_bytes" in metrics.text
        assert "# TYPE tandem_bus_handled_seconds histogram" in metrics.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert health_mod.main([url]) == 1  # nothing answers once it has stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_health_port_flag_and_env(monkeypatch):
    monkeypatch.setattr(service, "_health_port", 0)  # parse_args records the port; restored after the test
    monkeypatch.setenv("TANDEM_HEALTH_PORT", "8181")
    assert service.parse_args("x", per_agent=True, argv=["--config", "c", "--agent", "A"]).health_port == 8181
    args = service.parse_args("x", per_agent=True, argv=["--config", "c", "--agent", "A", "--health-port", "9"])
    assert args.health_port == 9
    monkeypatch.setenv("TANDEM_HEALTH_PORT", "eighty")
    with pytest.raises(SystemExit):
        service.parse_args("x", per_agent=False, argv=["--config", "c"])
    monkeypatch.delenv("TANDEM_HEALTH_PORT")
    assert service.parse_args("x", per_agent=False, argv=["--config", "c"]).health_port == 0
    monkeypatch.setenv("TANDEM_HEALTH_PORT", "0")
    assert health_mod.main([]) == 1  # a HEALTHCHECK without a port says so


async def test_run_service_answers_503_while_stopping(redis_url):
    bus = Bus(redis_url, "health", "svc")
    stop = asyncio.Event()
    cancelled, release = asyncio.Event(), asyncio.Event()
    port = free_port()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            await release.wait()  # e.g. finishing a train step before exiting
            raise

    runner = asyncio.create_task(service.run_service("svc.A", bus, stop, slow_to_stop(), health_port=port))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        resp = await first_response(client, "/health")
        assert resp.status_code == 200 and resp.json()["ok"] is True
        stop.set()
        await asyncio.wait_for(cancelled.wait(), 5)
        resp = await client.get("/health")
        assert resp.status_code == 503
        assert json.loads(resp.text) | {"uptime_s": 0} == {"service": "svc.A", "ok": False, "reason": "stopping",
                                                           "uptime_s": 0}
        release.set()
        await asyncio.wait_for(runner, 5)
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")


async def test_a_taken_health_port_fails_at_start(redis_url):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        bus = Bus(redis_url, "health", "svc")

        async def never() -> None:
            await asyncio.Event().wait()

        with pytest.raises(RuntimeError, match=f"health endpoint on port {port}"):
            await service.run_service("svc", bus, asyncio.Event(), never(), health_port=port)


def test_launcher_children_do_not_inherit_a_health_port(monkeypatch):
    from services.launcher.processes import child_env

    monkeypatch.setenv("TANDEM_HEALTH_PORT", "8080")  # e.g. `tandem up` inside the image: one port, many services
    assert "TANDEM_HEALTH_PORT" not in child_env({})


async def test_run_service_reports_what_ready_says(redis_url):
    bus = Bus(redis_url, "health", "svc")
    stop = asyncio.Event()
    state = {"ok": False}
    port = free_port()

    async def idle() -> None:
        await stop.wait()

    runner = asyncio.create_task(service.run_service(
        "svc.B", bus, stop, idle(), health_port=port,
        ready=lambda: (True, "") if state["ok"] else (False, "engines starting")))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        resp = await first_response(client, "/health")
        assert resp.status_code == 503 and resp.json()["reason"] == "engines starting"
        state["ok"] = True
        assert (await client.get("/health")).status_code == 200
    stop.set()
    await asyncio.wait_for(runner, 5)


async def test_under_torchrun_only_local_rank_0_serves_health(redis_url, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second process on this node: the port belongs to rank 0
    bus = Bus(redis_url, "health", "svc")
    stop = asyncio.Event()
    port = free_port()

    async def idle() -> None:
        await stop.wait()

    runner = asyncio.create_task(service.run_service("svc.C", bus, stop, idle(), health_port=port))
    await asyncio.sleep(0.3)
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{port}/health")
    stop.set()
    await asyncio.wait_for(runner, 5)


async def test_a_process_without_service_loops_serves_health_while_it_works():
    """The megatron follower ranks on other nodes run no loops but their pods are probed too."""
    port = free_port()
    release = asyncio.Event()

    async def follow() -> str:
        await release.wait()
        return "done"

    task = asyncio.create_task(service.serve_health_during("trainer.A", follow, health_port=port))
    async with httpx.AsyncClient(timeout=5) as client:
        for _ in range(50):
            try:
                resp = await client.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.ConnectError:
                await asyncio.sleep(0.05)
        assert resp.status_code == 200 and resp.json()["service"] == "trainer.A"
        release.set()
        assert await task == "done"
        with pytest.raises(httpx.ConnectError):  # closed with the work
            await client.get(f"http://127.0.0.1:{port}/health")
