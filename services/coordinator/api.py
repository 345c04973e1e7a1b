"""The control API (docs/architecture.md §6): FastAPI over the coordinator's run state.

Writes are guarded by a bearer token when ``api.token`` is configured. Bad
input gets a 4xx whose body says what is wrong, never a 500.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from services.common.metrics import SERVICE_STARTS, RunMetrics
from services.contracts.messages import Control
from services.coordinator.dashboard import mount as mount_dashboard
from services.coordinator.dashboard.routes import episode_record
from services.coordinator.scheduler import Coordinator


def create_app(coord: Coordinator) -> FastAPI:
    app = FastAPI(title="Tandem control API", version="1",
                  description="Drive and inspect a Tandem run (docs/architecture.md §6).")
    token = coord.cfg.api.token

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": "invalid request", "errors": errors})

    def writer(authorization: str | None = Header(default=None)) -> None:
        if token and not hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "this endpoint needs 'Authorization: Bearer <api.token>'")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "phase": coord.state.phase}

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return {**coord.state.status(), "evals": coord.evals}

    async def command(name: str) -> dict[str, Any]:
        if coord.state.phase in ("done", "stopped"):
            raise HTTPException(409, f"the run is {coord.state.phase}; {name} has no effect")
        await coord.control(name)
        return {"ok": True, "command": name, "paused": coord.state.paused}

    @app.post("/v1/pause", dependencies=[Depends(writer)])
    async def pause() -> dict[str, Any]:
        return await command("pause")

    @app.post("/v1/resume", dependencies=[Depends(writer)])
    async def resume() -> dict[str, Any]:
        return await command("resume")

    @app.post("/v1/stop", dependencies=[Depends(writer)])
    async def stop() -> dict[str, Any]:
        return await command("stop")

    @app.post("/v1/eval", dependencies=[Depends(writer)])
    async def run_eval() -> dict[str, Any]:
        if coord.state.phase not in ("training",):
            raise HTTPException(409, f"evaluation on demand runs during training; the run is {coord.state.phase}")
        if coord.eval_task is not None and not coord.eval_task.done():
            raise HTTPException(409, "an evaluation is already running")
        coord.eval_task = asyncio.create_task(coord.evaluate_all("on-demand"))
        return {"ok": True, "started": True}

    @app.post("/v1/checkpoint", dependencies=[Depends(writer)])
    async def checkpoint() -> dict[str, Any]:
        if coord.state.phase in ("done", "stopped"):
            raise HTTPException(409, f"the run is {coord.state.phase}; nothing to checkpoint")
        await coord.bus.publish(coord.bus.streams.control, Control(command="checkpoint"))
        return {"ok": True, "command": "checkpoint"}

    @app.get("/v1/episodes")
    async def episodes(limit: int = Query(50, ge=1, le=1000), offset: int = Query(0, ge=0),
                       purpose: Literal["train", "eval"] | None = None) -> dict[str, Any]:
        recs = list(coord.episodes.values())[::-1]
        if purpose:
            recs = [r for r in recs if r["purpose"] == purpose]
        page = recs[offset: offset + limit]
        return {"total": len(recs), "episodes": [
            {k: r[k] for k in ("id", "group_id", "purpose", "roles", "rewards", "summary")}
            | {"turns": len(r["turns"])} for r in page]}

    @app.get("/v1/episodes/{episode_id}")
    async def episode(episode_id: str) -> dict[str, Any]:
        return await episode_record(coord, episode_id)

    @app.get("/v1/metrics")
    async def metrics(agent: str | None = None) -> dict[str, Any]:
        if agent is not None and agent not in coord.state.agents:
            raise HTTPException(404, f"no agent {agent!r}; agents: {', '.join(coord.state.agents)}")
        names = [agent] if agent else list(coord.state.agents)
        return {n: {"train_steps": coord.state.agents[n].train_steps,
                    "group_rewards": coord.state.agents[n].group_rewards} for n in names}

    run_metrics = RunMetrics()

    @app.get("/metrics", response_class=Response)
    async def prometheus(request: Request) -> Response:
        """The run's Prometheus series (services/common/metrics.py), from the run state at this scrape."""
        await run_metrics.read_dead_letters(coord.bus.redis, coord.bus.streams.deadletter, coord.cfg.agents)
        await run_metrics.read_starts(coord.bus.redis, coord.bus.streams.key(SERVICE_STARTS))
        run_metrics.update(coord.state, coord.episodes, coord.evals)
        payload, content_type = run_metrics.exposition(request.headers.get("accept"))
        return Response(payload, media_type=content_type)

    mount_dashboard(app, coord)  # the web dashboard at / (services/coordinator/dashboard)
    return app
