"""Helpers the tests share: a Sample factory, wait-until pollers, ``tandem up`` runs, and the embedded engine (in
process, or as processes behind the real SGLang router) and Tinker server set-ups.

Imported as ``from tests.helpers import ...``; the fixtures built on them live in the test files (or conftest).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI
from pydantic import ValidationError

from services.common.admin_token import ADMIN_TOKEN_ENV
from services.common.bus import Bus
from services.common.embedded_redis import free_port
from services.common.sglang_router import list_workers, router_command, wait_healthy
from services.contracts.codec import FIELD, decode
from services.contracts.messages import Sample
from services.coordinator.ledger import GroupLedger

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "-test-admin-token"  # the tests' engines' and routers' admin token (a leading "-" is no flag)
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def make_sample(group: str = "g", reward: float = 0.0, *, agent: str = "A", size: int = 2, version: int = 0,
                episode_id: str = "e", tokens: Sequence[int] = (1, 2, 3), loss_mask: Sequence[int] = (0, 1, 1),
                logprobs: Sequence[float] = (0.0, -0.1, -0.2), **extra: Any) -> Sample:
    """A finished turn of role X with the given group, reward and weight version (the default: 3 tokens, 2 learned)."""
    return Sample(agent=agent, role="X", episode_id=episode_id, group_id=group, group_samples=size, tokens=list(tokens),
                  loss_mask=list(loss_mask), rollout_logprobs=list(logprobs), reward=reward,
                  weight_versions=[version], **extra)


async def read_all(bus: Bus, stream: str) -> list[Any]:
    """Every valid entry of ``stream`` as its flow's message type (invalid ones are skipped)."""
    model = bus.flow(stream).message
    out: list[Any] = []
    for _, fields in await bus.redis.xrange(stream):
        try:
            out.append(decode(fields[FIELD], model))
        except (KeyError, ValueError, ValidationError):
            continue
    return out


async def emit(bus: Bus, *samples: Sample) -> None:
    """The coordinator's emission of ``samples`` (the real ledger, one transaction per group): their stream
    entries and the group record the buffer takes membership and size from."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    ledger = GroupLedger(bus, sorted({s.agent for s in samples}))
    for gid, members in groups.items():
        await ledger.emit(gid, members, {})


async def commit_version(bus: Bus, agent: str, version: int, *, path: str | None = None,
                         metrics: dict[str, Any] | None = None, loaded: bool = False) -> dict[str, Any]:
    """What a trainer's commit of ``version`` leaves in Redis (its train-log record, the published version) and,
    if ``loaded``, the rollout's loaded-version key: the owners' records a coordinator reads events against."""
    import json

    s = bus.streams
    rec = {"version": version, "batch_id": f"b{version}", "sample_ids": [], "path": path or f"/ckpt/{agent}/v{version}",
           "checksum": "c", "metrics": {**(metrics or {}), "version": version, "batch_step": version}}
    await bus.redis.rpush(s.train_log(agent), json.dumps(rec))
    await bus.redis.set(s.published_weight_version(agent), version)
    if loaded:
        await bus.redis.set(s.loaded_weight_version(agent), version)
    return rec


def signed_proof(path: str | Path, agent: str, version: int) -> Any:
    """The trainer's proof of ``path`` as ``version`` of ``agent``, signed with the tests' run secret (conftest):
    what an engine started for that agent (``--agent``) needs before it loads it."""
    from services.common.weights_auth import WeightsProof, run_secret, sign, weights_checksum

    checksum = weights_checksum(path)
    return WeightsProof(checksum=checksum, signature=sign(run_secret(), agent, version, str(path), checksum))


def completion_sample(prompt: Sequence[int], out: Sequence[int], reward: float, group: str, version: int = 0,
                      logp: float = -5.0) -> Sample:
    """A sample whose prompt is masked out and whose completion ``out`` was sampled with logprob ``logp`` a token."""
    mask = [0] * len(prompt) + [1] * len(out)
    return make_sample(group, reward, version=version, tokens=[*prompt, *out], loss_mask=mask,
                       logprobs=[logp * m for m in mask])


def wait_until(predicate: Callable[[], T], timeout: float, what: str, proc: subprocess.Popen | None = None,
               errors: tuple[type[BaseException], ...] = (httpx.HTTPError, KeyError, ValueError),
               interval: float = 0.2) -> T:
    """Poll ``predicate`` until it returns something truthy (which is returned); ``errors`` it raises count as no.

    Fails naming ``what`` after ``timeout`` seconds, or at once when ``proc`` (e.g. a `tandem up`) has exited.
    """
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited ({proc.returncode}) while waiting for {what}")
        try:
            value = predicate()
        except errors:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def launch_up(config: Path, *flags: str, stdout: Any, text: bool = False,
              new_session: bool = False) -> subprocess.Popen:
    """``tandem up CONFIG FLAGS`` as a child run from the repository root, its output and errors to ``stdout``;
    with ``new_session``, in a process group of its own (as a terminal starts it: ``os.killpg`` is its Ctrl-C)."""
    return subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", str(config), *flags], cwd=REPO,
                            stdout=stdout, stderr=subprocess.STDOUT, text=text, start_new_session=new_session)


def run_up(config: Path, *flags: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    """``tandem up CONFIG FLAGS`` run to its end from the repository root, its output and errors captured."""
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", "up", str(config), *flags], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def stop_processes(procs: Sequence[subprocess.Popen]) -> None:
    """Terminate every process still running, then wait for each (killed after 10 s)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


async def _router_lists(router_url: str, engine_urls: list[str], logs: Path) -> None:
    await asyncio.gather(*(wait_healthy(u, timeout=180) for u in [*engine_urls, router_url]))  # a loaded machine
    for _ in range(300):
        if sorted(await list_workers(router_url, healthy_only=True, token=ADMIN_TOKEN)) == sorted(engine_urls):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the router never listed every engine; see {logs}")


@contextmanager
def engines_behind_router(model_dir: Path, logs: Path, engine_ids: Sequence[str],
                          *engine_args: str) -> Iterator[tuple[str, list[str]]]:
    """Real embedded engines (``python -m services.engine``, one per id, with ``engine_args``) behind the real
    SGLang router, all guarded by ``ADMIN_TOKEN``: (router URL, engine URLs) once the router lists every engine
    healthy; all stopped on exit. Each process logs to ``logs/<engine id>.log`` or ``logs/router.log``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", ADMIN_TOKEN_ENV: ADMIN_TOKEN}
    procs: list[subprocess.Popen] = []
    files = []
    try:
        urls = []
        for engine_id in engine_ids:
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            files.append((logs / f"{engine_id}.log").open("wb"))
            procs.append(subprocess.Popen([sys.executable, "-m", "services.engine", "--model-path", str(model_dir),
                                           "--port", str(port), "--engine-id", engine_id, *engine_args],
                                          cwd=REPO, env=env, stdout=files[-1], stderr=subprocess.STDOUT))
        rport = free_port()
        files.append((logs / "router.log").open("wb"))
        procs.append(subprocess.Popen(router_command(rport, urls, admin_token=ADMIN_TOKEN), cwd=REPO, env=env,
                                      stdout=files[-1], stderr=subprocess.STDOUT))
        router_url = f"http://127.0.0.1:{rport}"
        asyncio.run(_router_lists(router_url, urls, logs))
        yield router_url, urls
    finally:
        stop_processes(procs)
        for f in files:
            f.close()


@asynccontextmanager
async def engine_killed_and_back(fleet: Any) -> AsyncIterator[Any]:
    """Supervise ``fleet``, SIGKILL its first engine and wait (60 s) until the fleet has it back registered;
    yields that engine, and stops the supervision on exit."""
    e = fleet.engines[0]
    stop = asyncio.Event()
    watcher = asyncio.create_task(fleet.supervise(stop))
    try:
        assert e.proc is not None
        os.kill(e.proc.pid, signal.SIGKILL)
        for _ in range(600):
            if e.restarts == 1 and e.registered:
                break
            await asyncio.sleep(0.1)
        yield e
    finally:
        stop.set()
        await watcher


async def first_response(client: httpx.AsyncClient, path: str, tries: int = 100) -> httpx.Response:
    """GET ``path`` until the server behind ``client`` accepts connections."""
    for _ in range(tries - 1):
        try:
            return await client.get(path)
        except httpx.ConnectError:
            await asyncio.sleep(0.05)
    return await client.get(path)


@contextmanager
def engine_app(model_dir: Path, **options: Any) -> Iterator[FastAPI]:
    """The embedded engine's app (``create_app(model_dir, **options)``; admin token ``ADMIN_TOKEN`` unless
    given), its engine stopped on exit."""
    from services.engine.server import create_app

    app = create_app(model_dir, **{"admin_token": ADMIN_TOKEN, **options})
    try:
        yield app
    finally:
        app.state.engine.stop()


@asynccontextmanager
async def asgi_client(app: FastAPI, base_url: str = "http://e", http_timeout_s: float = 120,
                      headers: dict[str, str] | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client that calls ``app`` in process (sending ``headers`` with every request)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=base_url, timeout=http_timeout_s,
                                 headers=headers) as c:
        yield c


@contextmanager
def tinker_server(redis_url: str, root: Path) -> Iterator[Any]:
    """The Tandem Tinker API (tests/tinker_server.py) on ``redis_url``, stopped on exit."""
    from tests.tinker_server import TinkerServer

    srv = TinkerServer(redis_url, root).start()
    try:
        yield srv
    finally:
        srv.stop()


@contextmanager
def tinker_service(base_url: str, api_key: str) -> Iterator[Any]:
    """A ``tinker.ServiceClient`` of the server at ``base_url``, closed on exit."""
    import tinker

    client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    try:
        yield client
    finally:
        client.close("success").result()


async def play_group_over_bus(coord: Any, engine_bus: Bus, engine: Callable[[Any], Awaitable[None]],
                              roles: dict[str, Any], index: int, concurrency: int) -> list[Any]:
    """One training group of a real ``Coordinator`` played as its ``__main__`` runs it: its reply consumer and a
    stand-in rollout for agent A (``engine`` answers each turn request on ``engine_bus``) consume the bus until
    ``play_group(index, roles, f"g{index}")`` returns its results."""
    bus, stop = coord.bus, asyncio.Event()
    tasks = [asyncio.create_task(bus.consume(bus.streams.replies(coord.name), "coordinator", coord.name,
                                             coord.router.on_reply, stop, count=64)),
             asyncio.create_task(engine_bus.consume(bus.streams.turns("A"), "rollout", "rollout-A", engine, stop,
                                                    concurrency=concurrency))]
    try:
        return await asyncio.wait_for(coord.groups.play_group(index, roles, f"g{index}"), 120)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
