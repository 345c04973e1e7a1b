"""Redis faults are the run's, not a service's (services/common/reconnect.py): an outage or a full disk
(``MISCONF``) is waited out with the bus's backoff by every loop (the buffer's group timeout included), and the
control API answers ``/v1/status`` without its Redis-backed counts (and 503 elsewhere), never a 500.

A Valkey of the test's own (the session's is shared) is killed and restarted on its port, or given a data
directory on a small tmpfs that fills up."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_lib

from services.buffer.service import BufferService
from services.common.bus import Bus
from services.common.embedded_redis import EmbeddedRedis
from services.common.reconnect import DiskFull
from services.contracts.config import parse_config
from services.contracts.messages import Control
from services.coordinator.api import create_app
from services.coordinator.scheduler import Coordinator
from services.launcher.disk import DiskWatch


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(data_dir=tmp_path / "valkey").start()
    try:
        yield server
    finally:
        server.stop()


def config(url: str, tiny_model_dir: Path, tmp_path: Path) -> object:
    return parse_config({"run": {"name": "rf", "output_dir": str(tmp_path / "runs"), "group_timeout_s": 0.4},
                         "redis_url": url, "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                         "agents": {"A": {"model_path": str(tiny_model_dir)}}})


async def test_status_never_answers_500_while_redis_is_down(own_redis: EmbeddedRedis, tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    cfg = config(own_redis.url, tiny_model_dir, tmp_path)
    coord = Coordinator(cfg, Bus(own_redis.url, "rf", "coordinator"))  # type: ignore[arg-type]
    await coord.restore()
    transport = httpx.ASGITransport(app=create_app(coord))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        up = (await client.get("/v1/status")).json()
        assert up["redis"] == "ok" and up["rejected_replies"] == {}
        await asyncio.to_thread(own_redis._end)  # Valkey dies
        down = await client.get("/v1/status")
        assert down.status_code == 200, down.text
        assert down.json()["redis"].startswith("unavailable") and down.json()["rejected_replies"] is None
        assert down.json()["agents"]["A"]["step"] == 0  # the run's state, from memory
        for method, path in (("POST", "/v1/pause"), ("GET", "/v1/episodes/nope"), ("GET", "/metrics")):
            answer = await client.request(method, path)
            assert answer.status_code == 503 and "Redis is unavailable" in answer.json()["detail"], (path, answer.text)
            assert answer.headers["Retry-After"] == "5"
        doc = (await client.get("/openapi.json")).json()
        assert "503" in doc["paths"]["/v1/pause"]["post"]["responses"]
        await asyncio.to_thread(own_redis.start)
        assert (await client.get("/v1/status")).json()["redis"] == "ok"
    await coord.bus.close()


async def test_the_buffers_group_timeout_waits_out_an_outage(own_redis: EmbeddedRedis, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    """Issue 33: the timeout loop called Redis outside the backoff, so every Valkey death killed both buffers."""
    cfg = config(own_redis.url, tiny_model_dir, tmp_path)
    bus = Bus(own_redis.url, "rf", "buffer-A")
    buffer = BufferService(cfg, "A", bus)  # type: ignore[arg-type]
    stop = asyncio.Event()
    loop = asyncio.create_task(buffer.abandon_overdue(stop))
    await asyncio.sleep(0.5)
    await asyncio.to_thread(own_redis._end)
    await asyncio.sleep(1.5)  # a few rounds of the loop against a dead Redis
    assert not loop.done(), loop.exception() if loop.done() else ""
    await asyncio.to_thread(own_redis.start)
    await asyncio.sleep(0.5)
    assert not loop.done()
    stop.set()
    await asyncio.wait_for(loop, 10)
    await bus.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_a_full_disk_is_waited_out_and_the_write_lands_once_space_returns(small_disk: Path) -> None:
    """Valkey on a 1 MB tmpfs: once its AOF cannot be written it answers MISCONF; a publish then waits (DiskFull,
    the bus's backoff) instead of failing the service, and lands when space is freed."""
    server = EmbeddedRedis(data_dir=small_disk / "valkey", appendfsync="everysec").start()
    bus = Bus(server.url, "df", "coordinator")
    ballast = small_disk / "ballast"
    try:
        with contextlib.suppress(OSError):  # fill the disk
            with ballast.open("wb") as f:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        said: list[str] = []
        client = redis_lib.Redis.from_url(server.url)
        watch = DiskWatch([small_disk / "valkey"], lambda: client.info("persistence"), said.append, low_free=64 << 10)
        direct = None
        for _ in range(50):  # the AOF write fails, then every write is refused with MISCONF
            try:
                await bus.redis.set("tandem:df:probe", "x" * 10000)
            except DiskFull as exc:
                direct = exc
                break
            await asyncio.sleep(0.1)
        assert direct is not None and "MISCONF" in str(direct) and "disk" in str(direct)
        publish = asyncio.create_task(bus.publish(bus.streams.control, Control(command="checkpoint")))
        await asyncio.sleep(1.5)
        assert not publish.done(), publish.exception() if publish.done() else ""  # waiting, not failed
        watch.check()
        watch.check()  # said once per fault
        assert len(said) == 1 and said[0].startswith(f"disk full at {small_disk / 'valkey'}"), said
        assert "the run is paused" in said[0] and "--resume" in said[0]
        ballast.unlink()  # space returns
        await asyncio.wait_for(publish, 30)
        assert await bus.redis.xlen(bus.streams.control) == 1
        for _ in range(50):  # Valkey's next AOF write succeeds: the launcher says the run goes on
            watch.check()
            if len(said) == 2:
                break
            await asyncio.sleep(0.2)
        assert said[1] == "disk space is back: the run goes on"
        client.close()
    finally:
        await bus.close()
        server.stop()


async def test_the_done_id_grace_is_a_run_setting_shared_by_the_wait_window(redis_url: str, tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """``run.done_ids_grace_s`` sets how long a service waits out Redis and how long its done-id sets keep an id
    past the stream's retention: equal, so a retried publish can never outlive the id that makes it a repeat."""
    cfg = parse_config({"run": {"name": "grace", "done_ids_grace_s": 45}, "redis_url": redis_url,
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir)}}})
    from services.common.bus.consume import ConsumeLoop

    async def handler(_: object) -> None:
        return None

    bus = Bus(redis_url, "grace", "buffer-A", reconnect_window_s=cfg.run.done_ids_grace_s)
    loop = ConsumeLoop(bus, bus.streams.control, "g", "c", handler, concurrency=1, count=1, block_ms=10,
                       claim_idle_ms=1000, start="0", max_deliveries=3)
    assert loop.done.grace_ms == 45_000 and bus.reconnect_window_s == 45
    with pytest.raises(ValueError, match="done_ids_grace_s"):
        parse_config({"run": {"name": "g", "done_ids_grace_s": 1}, "environment": {"name": "tictactoe",
                      "roles": {"X": "A", "O": "A"}}, "agents": {"A": {"model_path": str(tiny_model_dir)}}})
    await bus.close()
