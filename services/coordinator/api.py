"""The control API (docs/architecture.md §6): FastAPI over the coordinator's run state.

When ``api.token`` is configured, every route but ``/health``, ``/metrics``, the OpenAPI document
(``/docs``, ``/openapi.json``) and the dashboard's page, assets and ``/v1/dashboard/info`` (which
tells the page that a token is needed) requires ``Authorization: Bearer <api.token>``, reads as
well as writes; the comparison is constant-time. ``/health`` and ``/metrics`` stay open for probes
and scrapers (no transcript, path or URL in them). Bad input gets a 4xx whose body says what is
wrong, never a 500; the OpenAPI document lists every status a route answers with its real body
(services/coordinator/errors.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.common.admin_token import authorized
from services.common.bus import Bus
from services.common.metrics import SERVICE_STARTS
from services.common.reconnect import REDIS_DOWN
from services.contracts.config import TandemConfig
from services.contracts.messages import Control
from services.contracts.players import Player
from services.contracts.status import RunStatus
from services.coordinator.dashboard import DashboardSource
from services.coordinator.dashboard import mount as mount_dashboard
from services.coordinator.dashboard.routes import episode_record
from services.coordinator.episodes import EpisodeLog
from services.coordinator.errors import responses
from services.coordinator.evals import Evaluations
from services.coordinator.replies import ReplyCheck
from services.coordinator.run_metrics import RunMetrics
from services.coordinator.scheduler import Coordinator
from services.coordinator.state import RunState
from services.coordinator.train_play import curve
from services.envs.base import Environment


@dataclass(frozen=True)
class ApiParts:
    """What the API reads and drives: the coordinator's parts (scheduler.py), not the coordinator."""

    cfg: TandemConfig
    env_cls: type[Environment]
    state: RunState
    bus: Bus
    episodes: EpisodeLog
    evals: Evaluations
    replies: ReplyCheck
    control: Callable[[str], Awaitable[None]]  # pause / resume / stop
    tokenizer_for: Callable[[Player], Any]
    reply_stream: str

    @classmethod
    def of(cls, coord: Coordinator) -> ApiParts:
        return cls(coord.cfg, coord.groups.env_cls, coord.state, coord.bus, coord.episode_log, coord.evaluations,
                   coord.router.replies, coord.control, coord.players.tokenizer_for, coord.router.reply_stream)


def create_app(coord: Coordinator) -> FastAPI:
    return build_app(ApiParts.of(coord))


def build_app(p: ApiParts) -> FastAPI:
    """The API over the run's parts: each route group gets the objects it reads or drives."""
    app = FastAPI(title="Tandem control API", version="1",
                  description="Drive and inspect a Tandem run (docs/architecture.md §6).")
    app.exception_handler(RequestValidationError)(_bad_request)
    for down in REDIS_DOWN:  # an outage of the run's store: 503 with its reason, never a 500
        app.exception_handler(down)(_redis_down)
    guard = token_guard(p.cfg.api.token)
    _probe_routes(app, p.state, RunSeries(p.bus, list(p.cfg.agents), p.state, p.episodes, p.evals))
    _read_routes(app, p.state, p.episodes, p.evals, p.replies, guard)
    _command_routes(app, p.state, p.control, p.evals, p.bus, guard)
    mount_dashboard(app, DashboardSource(p.cfg, p.env_cls, p.state, p.episodes, p.tokenizer_for, p.bus,
                                         p.reply_stream), guard)  # the web dashboard at /
    return app


async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [{"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()]
    return JSONResponse(status_code=422, content={"detail": "invalid request", "errors": errors})


async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=503, headers={"Retry-After": "5"},
                        content={"detail": f"Redis is unavailable ({exc}); retry shortly: the run waits for it"})


BEARER = HTTPBearer(auto_error=False, scheme_name="api.token",
                    description="the run's api.token, when configured: 'Authorization: Bearer <api.token>'")


def token_guard(token: str) -> list[Any]:
    """The dependencies of a guarded route: ``Authorization: Bearer <token>`` (constant-time compare) when a
    token is configured, none otherwise (the OpenAPI document then lists the bearer scheme on the route)."""

    def require_token(credentials: HTTPAuthorizationCredentials | None = Security(BEARER)) -> None:
        given = f"Bearer {credentials.credentials}" if credentials is not None else None
        if not authorized(given, token):
            raise HTTPException(401, "this endpoint needs 'Authorization: Bearer <api.token>'",
                                headers={"WWW-Authenticate": "Bearer"})

    return [Security(require_token)] if token else []


@dataclass
class RunSeries:
    """The run's Prometheus series (services/coordinator/run_metrics.py) and what they are read from."""

    bus: Bus
    agents: list[str]
    state: RunState
    episodes: EpisodeLog
    evals: Evaluations
    metrics: RunMetrics = field(default_factory=RunMetrics)

    async def exposition(self, accept: str | None) -> tuple[bytes, str]:
        await self.metrics.read_dead_letters(self.bus.redis, self.bus.streams.deadletter, self.agents)
        await self.metrics.read_starts(self.bus.redis, self.bus.streams.key(SERVICE_STARTS))
        self.metrics.update(self.state, self.episodes.recent, self.evals.entries)
        return self.metrics.exposition(accept)


def _probe_routes(app: FastAPI, state: RunState, series: RunSeries) -> None:
    """Open to probes and scrapers: liveness and the Prometheus series."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "phase": state.phase}

    @app.get("/metrics", response_class=Response, responses=responses(503))
    async def prometheus(request: Request) -> Response:
        """The run's Prometheus series (services/coordinator/run_metrics.py), from the run state at this scrape."""
        payload, content_type = await series.exposition(request.headers.get("accept"))
        return Response(payload, media_type=content_type)


def _read_routes(app: FastAPI, state: RunState, kept: EpisodeLog, evals: Evaluations, replies: ReplyCheck,
                 guard: list[Any]) -> None:
    """The run's status, episodes (full transcripts) and metrics: behind the token when one is configured."""

    @app.get("/v1/status", dependencies=guard, responses=responses(401), response_model=RunStatus,
             response_model_exclude_unset=True)  # an older run's evaluation lacks the keys added since
    async def status() -> RunStatus:
        """The run's state (in memory); while Redis is unavailable its Redis-backed counts are null."""
        try:
            rejected, redis = await replies.counts(), "ok"  # engine replies refused (replies.py)
        except REDIS_DOWN as exc:
            rejected, redis = None, f"unavailable: {exc}"
        return RunStatus.model_validate({**state.status(), "evals": evals.entries, "rejected_replies": rejected,
                                         "redis": redis})

    @app.get("/v1/episodes", dependencies=guard, responses=responses(401, 422))
    async def episodes(limit: int = Query(50, ge=1, le=1000), offset: int = Query(0, ge=0),
                       purpose: Literal["train", "eval"] | None = None) -> dict[str, Any]:
        recs = list(kept.recent.values())[::-1]
        if purpose:
            recs = [r for r in recs if r["purpose"] == purpose]
        page = recs[offset: offset + limit]
        return {"total": len(recs), "episodes": [
            {k: r[k] for k in ("id", "group_id", "purpose", "roles", "rewards", "summary")}
            | {"turns": len(r["turns"])} for r in page]}

    @app.get("/v1/episodes/{episode_id}", dependencies=guard, responses=responses(401, 404, 503))
    async def episode(episode_id: str) -> dict[str, Any]:
        return await episode_record(kept, episode_id)

    @app.get("/v1/metrics", dependencies=guard, responses=responses(401, 404))
    async def metrics(agent: str | None = None) -> dict[str, Any]:
        if agent is not None and agent not in state.agents:
            raise HTTPException(404, f"no agent {agent!r}; agents: {', '.join(state.agents)}")
        names = [agent] if agent else list(state.agents)
        return {n: {"train_steps": state.agents[n].train_steps,
                    "group_rewards": state.agents[n].group_rewards,
                    "train_play": curve(state.agents[n].train_play)} for n in names}


def _command_routes(app: FastAPI, state: RunState, control: Callable[[str], Awaitable[None]], evals: Evaluations,
                    bus: Bus, guard: list[Any]) -> None:
    """Pause, resume, stop, evaluate, checkpoint: behind the token when one is configured."""
    answers = responses(401, 409, 503)

    async def command(name: str) -> dict[str, Any]:
        if state.phase in ("done", "stopped"):
            raise HTTPException(409, f"the run is {state.phase}; {name} has no effect")
        await control(name)
        return {"ok": True, "command": name, "paused": state.paused}

    @app.post("/v1/pause", dependencies=guard, responses=answers)
    async def pause() -> dict[str, Any]:
        return await command("pause")

    @app.post("/v1/resume", dependencies=guard, responses=answers)
    async def resume() -> dict[str, Any]:
        return await command("resume")

    @app.post("/v1/stop", dependencies=guard, responses=answers)
    async def stop() -> dict[str, Any]:
        return await command("stop")

    @app.post("/v1/eval", dependencies=guard, responses=answers)
    async def run_eval() -> dict[str, Any]:
        if state.phase not in ("training",):
            raise HTTPException(409, f"evaluation on demand runs during training; the run is {state.phase}")
        if not evals.start_on_demand():
            raise HTTPException(409, "an evaluation is already running")
        return {"ok": True, "started": True}

    @app.post("/v1/checkpoint", dependencies=guard, responses=answers)
    async def checkpoint() -> dict[str, Any]:
        if state.phase in ("done", "stopped"):
            raise HTTPException(409, f"the run is {state.phase}; nothing to checkpoint")
        await bus.publish(bus.streams.control, Control(command="checkpoint"))
        return {"ok": True, "command": "checkpoint"}
