"""The rollout's engines and router as child processes: start, register, watch, restart.

``EngineFleet.start()`` starts the real SGLang router (no workers) and ``num_engines`` engines
(``services/rollout/commands.py``) unless ``spawn.spawn_early`` already did (the rollout starts them
before its own imports), waits for each engine's ``/health`` (asked every ``HEALTH_POLL_S``) and
registers it with the router at run time (``POST /workers``). ``supervise()`` then checks every engine each
``interval`` seconds: a process that exited, or one whose ``/health_generate`` fails or does not
answer within ``health_timeout`` seconds (or 4 x the slowest recent answer, when longer) ``max_failures``
times in a row (hung), is deregistered
(``DELETE /workers/{id}``: traffic moves to the healthy ones), killed and started again on its
port; the latest weight version loaded on the fleet is applied to it before it is registered
again. A router that exited is started again on its port, and every live engine is registered
with it again (on the fleet's latest version); generation that failed meanwhile is retried by the
rollout. ``load_weights`` and re-registration share one lock, so a restarted engine can never
rejoin on an older version than the rest.

A version that is a LoRA adapter directory (the trainer's export under ``lora``) is loaded with
``/load_lora_adapter`` instead, on the resident base (``services/rollout/adapters.py``): ``sync`` says
which adapters every engine holds and which one turns are generated under; a restarted engine loads the
kept ones before it is registered. A fleet other agents share (``shared_with``: their rollouts drive its
router as an external router) also loads the adapters they need (``shared``: their records,
``adapters.read_kept``) on every engine it registers, before and once more after registering it (a version
a sharing rollout records meanwhile), so a restarted engine serves every agent again.

The fleet makes the run's admin token (``services/common/admin_token.py``, or takes ``$TANDEM_ADMIN_TOKEN``)
and gives it to its engines through their environment and to the router as its API keys; every admin
call it makes carries it (docs/architecture.md §2.3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.common.adapter_dir import is_adapter_dir
from services.common.latency import LatencyWindow
from services.common.sglang_router import add_worker, remove_worker, router_command, wait_healthy
from services.common.weights_auth import WeightsProof
from services.contracts.config import AgentConfig
from services.rollout.adapters import AdapterSync, Served
from services.rollout.commands import engine_command
from services.rollout.engine_client import EngineClient, EngineClientError
from services.rollout.spawn import Proc, Spawned, plan, spawn

HEALTH_POLL_S = 0.05  # how often a starting engine's /health is asked (a refused connection costs microseconds)
SUSPECT_S = 5.0  # an engine whose health check has hung this long is taken as recovering

log = logging.getLogger("tandem.rollout.fleet")


@dataclass
class ManagedEngine:
    index: int
    port: int
    host: str
    proc: Proc | None = None
    registered: bool = False
    restarts: int = 0
    failures: int = 0
    weight_version: int = 0
    load: dict[str, Any] = field(default_factory=dict)
    last_ok: float = field(default_factory=time.monotonic)  # when it last passed a health check (or started)
    adapters: set[str] = field(default_factory=set)  # the LoRA adapters it holds, by name

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class EngineFleet:
    def __init__(self, agent: str, acfg: AgentConfig, host: str = "127.0.0.1", interval: float = 1.0,
                 health_timeout: float = 20.0, max_failures: int = 3, start_timeout: float = 600.0,
                 early: Spawned | None = None, shared_with: tuple[str, ...] = (),
                 shared: Callable[[], Awaitable[list[Served]]] | None = None) -> None:
        """``early``: the engines and router ``spawn.spawn_early`` already started (their ports and token);
        ``shared_with``: the agents sharing these engines; ``shared``: the adapters they need on every engine."""
        self.agent, self.acfg, self.host = agent, acfg, host
        self.shared_with, self.shared = shared_with, shared
        self.interval, self.health_timeout = interval, health_timeout
        self.max_failures, self.start_timeout = max_failures, start_timeout
        early = early or plan(acfg)
        self.engines = [ManagedEngine(i, port, host) for i, port in enumerate(early.engine_ports)]
        for e, proc in zip(self.engines, early.engines, strict=False):
            e.proc = proc
        self.router_port = early.router_port
        self.router_url = f"http://{host}:{self.router_port}"
        self.router: Proc | None = early.router
        self.router_restarts = 0
        self.latest: tuple[str, int] | None = None  # (path, version) last loaded on the fleet
        self.latest_proof: WeightsProof | None = None  # its checksum and signature (engines verify them)
        self._lock = asyncio.Lock()
        self.token = early.token  # the admin token of this run's engines and router
        self._http = httpx.AsyncClient(timeout=health_timeout)
        self.probe_seconds = LatencyWindow()  # /health_generate answers: the health timeout follows them
        self._client = EngineClient(self.router_url, timeout=300.0, token=self.token)
        self.sync = AdapterSync(agent, self._client)

    def _spawn(self, cmd: list[str]) -> Proc:
        return spawn(cmd, self.token)

    def _router_command(self) -> list[str]:
        return router_command(self.router_port, [], host=self.host, admin_token=self.token)

    async def start(self) -> None:
        """Start (or, after ``spawn_early``, wait for) the engines and the router, then register the engines."""
        for e in self.engines:
            if e.proc is None:
                e.proc = self._spawn(engine_command(self.acfg, self.agent, e.index, e.port, self.host,
                                                          self.shared_with))
        if self.router is None:
            self.router = self._spawn(self._router_command())
        await asyncio.gather(*(self._boot(e) for e in self.engines))
        await self._router_up()
        await asyncio.gather(*(self._register(e) for e in self.engines))
        log.info("router %s with %d engine(s) up", self.router_url, len(self.engines))

    async def _router_up(self, tries: int = 3, within_s: float = 60.0) -> None:
        """Wait for the router to answer ``/health``. One that exits while starting is started again (its
        metrics port is picked free and then bound by the router, so another process may take it in between:
        the router then exits at once), with a new metrics port each time, ``tries`` times in all."""
        assert self.router is not None
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.router.returncode is not None:
                tries -= 1
                if tries <= 0:
                    raise RuntimeError(f"the SGLang router exited with code {self.router.returncode} while starting")
                log.warning("the SGLang router exited with code %s while starting: starting it again",
                            self.router.returncode)
                self.router = self._spawn(self._router_command())
            with contextlib.suppress(httpx.HTTPError):
                if (await self._http.get(f"{self.router_url}/health", timeout=2.0)).status_code == 200:
                    return
            await asyncio.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"the SGLang router at {self.router_url} not healthy after {within_s:.0f}s")

    async def _boot(self, e: ManagedEngine) -> None:
        """Wait for engine ``e`` (spawning it when it has no live process) to answer ``/health``."""
        if not e.alive():
            e.proc = self._spawn(engine_command(self.acfg, self.agent, e.index, e.port, self.host,
                                                          self.shared_with))
        assert e.proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if not e.alive():
                raise RuntimeError(f"engine {e.url} exited with code {e.proc.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if (await self._http.get(f"{e.url}/health", timeout=2.0)).status_code == 200:
                    return
            await asyncio.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"engine {e.url} not healthy after {self.start_timeout:.0f}s")

    async def _register(self, e: ManagedEngine) -> None:
        async with self._lock:  # the latest version first, then traffic
            if self.latest is not None and (e.weight_version != self.latest[1] or self.sync.missing(e.adapters)):
                await self._apply(e, *self.latest, self.latest_proof)
                e.weight_version = self.latest[1]
            await self._load_shared(e)  # a RuntimeError (their record unreadable) leaves it out, to try again
            await add_worker(self.router_url, e.url, timeout=60, token=self.token)
            e.registered, e.failures = True, 0
            try:
                await self._load_shared(e)  # a version a sharing rollout recorded while it registered
            except RuntimeError as exc:
                log.warning("engine %s: %s", e.url, exc)

    async def _load_shared(self, e: ManagedEngine) -> None:
        """Load on engine ``e`` the adapters the agents sharing the fleet need and it lacks. One that fails is
        logged: the sharing rollout's own load (or its next version) puts it there, this engine serves the rest."""
        for s in await self.shared() if self.shared is not None else []:
            if s.name in e.adapters:
                continue
            try:
                await self._client.load_adapter(e.url, s.name, s.path, s.proof)
                e.adapters.add(s.name)
            except EngineClientError as exc:
                log.warning("engine %s: could not load %s for an agent sharing it: %s", e.url, s.name, exc)

    async def _apply(self, e: ManagedEngine, path: str, version: int, proof: WeightsProof | None) -> None:
        """Put engine ``e`` on ``version``: an adapter (with every kept one) on its base, or full weights."""
        if is_adapter_dir(path):
            await self.sync.catch_up(e.url, e.adapters)
            await self.sync.load(e.url, e.adapters, path, version, proof)
        else:
            await self._client.update_weights(e.url, path, version, proof)

    async def _deregister(self, e: ManagedEngine) -> None:
        if e.registered:
            e.registered = False
            with contextlib.suppress(KeyError, RuntimeError, TimeoutError, httpx.HTTPError):
                await remove_worker(self.router_url, e.url, timeout=10, token=self.token)

    async def load_weights(self, path: str, version: int, rejoin_timeout: float | None = None,
                           proof: WeightsProof | None = None) -> list[str]:
        """Load ``path`` as ``version`` on every registered engine (with the trainer's ``proof``, which each engine
        checks); a restarting one gets it on rejoin.

        An engine that dies under the update (it exited, or the connection broke) is deregistered and left to
        ``supervise`` to restart: it loads this version when it rejoins. When that (or a restart already under
        way) leaves no engine with the version, wait up to ``rejoin_timeout`` (default ``start_timeout``) for
        one to rejoin rather than fail the update (its redelivery would wait for the bus's reclaim, and an
        on-policy agent stall meanwhile). An engine that answers but refuses the weights fails the update."""
        async with self._lock:
            live = [e for e in self.engines if e.registered]
            results = await asyncio.gather(*(self._apply(e, path, version, proof) for e in live),
                                           return_exceptions=True)
            lost = [e for e, r in zip(live, results, strict=True) if isinstance(r, BaseException) and _died(e, r)]
            refused = [r for e, r in zip(live, results, strict=True) if isinstance(r, BaseException) and e not in lost]
            if refused:
                raise refused[0]
            self.latest, self.latest_proof = (path, version), proof  # once every live engine loaded it (or died)
            loaded = [e for e in live if e not in lost]
            for e in loaded:
                e.weight_version = version
            if is_adapter_dir(path):  # turns go under it from now on; versions beyond the kept ones go
                old = self.sync.record(path, version, proof)
                await asyncio.gather(*(self.sync.unload(e.url, e.adapters, old) for e in loaded))
            for e in lost:
                log.warning("engine %s died while loading version %d: it loads it when it rejoins", e.url, version)
                await self._deregister(e)
                if e.alive():
                    e.proc.kill()  # type: ignore[union-attr]
        if loaded:
            return [e.url for e in loaded]
        return await self._rejoined(version, self.start_timeout if rejoin_timeout is None else rejoin_timeout)

    async def _rejoined(self, version: int, wait_s: float) -> list[str]:
        """The engines registered on ``version`` (or later) once one is, or none after ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            back = [e.url for e in self.engines if e.registered and e.weight_version >= version]
            if back:
                return back
            await asyncio.sleep(0.25)
        return []

    async def supervise(self, stop: asyncio.Event) -> None:
        restarting: dict[int, asyncio.Task[None]] = {}
        while not stop.is_set():
            watched = [e for e in self.engines if e.index not in restarting or restarting[e.index].done()]
            for e, ok in zip(watched, await asyncio.gather(*(self._check(e) for e in watched)), strict=True):
                if not ok:
                    restarting[e.index] = asyncio.create_task(self._restart(e))
            if self.router is not None and self.router.returncode is not None:
                await self._restart_router()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
        for t in restarting.values():
            t.cancel()

    async def _restart_router(self) -> None:
        """The router died: start it again on its port and register the engines that are up (it keeps no
        state of its own: its workers are re-registered, on the version the fleet has loaded)."""
        assert self.router is not None
        log.warning("the SGLang router exited with code %s: restarting it", self.router.returncode)
        async with self._lock:
            for e in self.engines:
                e.registered = False  # nothing is routed to them until the new router lists them
        while True:
            self.router = self._spawn(self._router_command())
            try:
                await wait_healthy(self.router_url, timeout=60)
                break
            except TimeoutError as exc:
                log.warning("the restarted router did not come up (%s); trying again", exc)
                if self.router.returncode is None:
                    self.router.kill()
                await self.router.wait()
                await asyncio.sleep(2.0)
        self.router_restarts += 1
        up = [e for e in self.engines if e.alive()]
        results = await asyncio.gather(*(self._register(e) for e in up), return_exceptions=True)
        for e, res in zip(up, results, strict=True):
            if isinstance(res, BaseException):  # the engine check restarts it, and it registers then
                log.warning("engine %s did not re-register with the new router: %s", e.url, res)
        log.info("router %s is back (restart %d) with %d engine(s)", self.router_url, self.router_restarts,
                 self.healthy())

    async def _check(self, e: ManagedEngine) -> bool:
        """False when the engine must be restarted."""
        if not e.alive():
            log.warning("engine %s died (exit code %s)", e.url, e.proc.returncode if e.proc else None)
            return False
        try:
            started = time.monotonic()
            probe = await self._http.get(f"{e.url}/health_generate",
                                         timeout=self.probe_seconds.bound(self.health_timeout))
            ok = probe.status_code == 200
            if ok:
                self.probe_seconds.add(time.monotonic() - started)
            load = (await self._http.get(f"{e.url}/get_load", timeout=2.0)).json()
            if isinstance(load, list) and load and isinstance(load[0], dict):
                e.load = {k: int(v) for k, v in load[0].items() if k in ("num_reqs", "num_waiting_reqs", "num_tokens")}
        except (httpx.HTTPError, ValueError):
            ok = False
        e.failures = 0 if ok else e.failures + 1
        e.last_ok = time.monotonic() if ok else e.last_ok
        if e.failures >= self.max_failures:
            log.warning("engine %s failed %d health checks in a row: restarting it", e.url, e.failures)
            return False
        return True

    async def _restart(self, e: ManagedEngine) -> None:
        await self._deregister(e)
        if e.alive():
            assert e.proc is not None
            e.proc.kill()
        if e.proc is not None:
            await e.proc.wait()
        e.restarts += 1
        e.weight_version, e.load, e.last_ok = 0, {}, time.monotonic()
        e.adapters.clear()
        while True:
            try:
                await self._boot(e)
                await self._register(e)
                log.info("engine %s is back (restart %d)", e.url, e.restarts)
                return
            except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
                log.warning("restarting engine %s failed: %s; trying again", e.url, exc)
                if e.alive():
                    e.proc.kill()  # type: ignore[union-attr]
                    await e.proc.wait()  # type: ignore[union-attr]
                await asyncio.sleep(2.0)

    def healthy(self) -> int:
        return sum(1 for e in self.engines if e.registered)

    async def engine_urls(self) -> list[str]:
        """Every engine of the fleet, registered or not (a call may still run on one being restarted)."""
        return [e.url for e in self.engines]

    async def resume(self, path: str, version: int, proof: WeightsProof | None) -> None:
        """A restarted rollout's fresh engines: put them on the version the agent had loaded."""
        await self.load_weights(path, version, proof=proof)

    async def status(self) -> list[dict[str, Any]]:
        return self.snapshot()

    def recovering(self) -> bool:
        """Whether an engine is out of the router (restarting), failing its health checks, or has passed none
        for ``SUSPECT_S`` (a check that hangs): generation that fails meanwhile is held for it (the rollout)."""
        now = time.monotonic()
        return any(not e.registered or e.failures or now - e.last_ok > SUSPECT_S for e in self.engines)

    def snapshot(self) -> list[dict[str, Any]]:
        """Each engine's state; ``silent_s`` grows from its last passed health check while a check hangs (a
        stopped engine is named by it within seconds, long before the restart's ``max_failures`` checks)."""
        now = time.monotonic()
        return [{"url": e.url, "healthy": e.registered, "pid": e.proc.pid if e.proc else None,
                 "restarts": e.restarts, "weight_version": e.weight_version, **e.load,
                 "silent_s": round(now - e.last_ok, 1)} for e in self.engines]

    async def close(self) -> None:
        procs = [p for p in [*(e.proc for e in self.engines), self.router] if p is not None and p.returncode is None]
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 10)
            except TimeoutError:
                p.kill()
                await p.wait()
        await self._http.aclose()
        await self._client.aclose()


def _died(e: ManagedEngine, exc: BaseException) -> bool:
    """Whether a failed call to engine ``e`` failed because the engine is gone (exited, or its connection broke:
    an httpx transport error), as opposed to an answer refusing it."""
    return not e.alive() or isinstance(exc.__cause__, httpx.TransportError)
