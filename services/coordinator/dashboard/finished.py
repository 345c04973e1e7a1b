"""A finished run's dashboard, read-only, from its files (``tandem dashboard RUN``).

The same page as the live one, served from ``runs/<run>/``: ``config.json`` (the run's config, written with
its report; ``--run-config`` for a run without one), ``summary.json`` (status, evaluations, the agents' groups)
and ``metrics.json`` (the charts), the transcript archive (``transcripts.jsonl.gz``, read through its index,
or by walking it when it has none) and the newest transcripts, which the run's Redis still held: its AOF
(``redis/``) is loaded by an embedded Valkey started on a temporary copy, read once and stopped. Nothing
under the run directory is written and nothing trains; the control routes answer 405.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from services.common.embedded_redis import EmbeddedRedis
from services.contracts.config import TandemConfig, parse_config
from services.contracts.players import AgentPlayer, Local, Player
from services.contracts.streams import Streams
from services.coordinator.archive import ARCHIVE_NAME, INDEX_NAME, archive_find, archive_page
from services.coordinator.dashboard.routes import NO_CACHE, episode_routes, run_info
from services.coordinator.dashboard.transcripts import tokens_key
from services.envs.registry import load_environment

CONFIG_NAME = "config.json"
CONTROLS = ("pause", "resume", "stop", "checkpoint", "eval")


def held_transcripts(run_dir: Path, run: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The transcripts (oldest first, per purpose) and reply tokens the run's Redis held when it ended, read
    from a copy of its AOF; nothing when the run has no ``redis/`` directory (an external Redis)."""
    src = run_dir / "redis"
    if not src.is_dir():
        return {}, {}
    import redis

    streams = Streams(run)
    with tempfile.TemporaryDirectory(prefix="tandem-view-") as tmp:
        copy = Path(tmp) / "redis"
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns("*.log", "*.pid"))
        server = EmbeddedRedis(data_dir=copy, appendonly=True).start(timeout=120)
        try:
            client = redis.Redis.from_url(server.url)
            held = client.hgetall(streams.episodes())
            order = [i.decode() for p in ("train", "eval")
                     for i in client.lrange(streams.key(f"episodes:order:{p}"), 0, -1)]
            order += [k.decode() for k in held if k.decode() not in set(order)]
            records = {i: json.loads(held[i.encode()]) for i in order if i.encode() in held}
            raws = client.mget([tokens_key(streams.key, i) for i in records]) if records else []
            tokens = {i: json.loads(raw) for i, raw in zip(records, raws, strict=True) if raw is not None}
            client.close()
        finally:
            server.stop()
    return records, tokens


@dataclass
class FinishedRun:
    """A finished run's files, read once: what the read-only dashboard serves."""

    dir: Path
    cfg: TandemConfig
    summary: dict[str, Any]
    metrics: dict[str, Any]
    recent: dict[str, dict[str, Any]] = field(default_factory=dict)
    held_tokens: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, run_dir: Path, config: Path | None = None) -> FinishedRun:
        path = config or run_dir / CONFIG_NAME
        if not path.is_file():
            raise ValueError(f"{run_dir} has no {CONFIG_NAME} (a run from before it was written): pass the run's "
                             "config with --run-config")
        if path.suffix == ".json":
            cfg = parse_config(json.loads(path.read_text()), str(path))
        else:
            from services.contracts.config import load_config

            cfg = load_config(path)
        summary = _json(run_dir / "summary.json")
        if summary is None:
            raise ValueError(f"{run_dir}/summary.json is missing: the run has not finished (or is not a run)")
        recent, tokens = held_transcripts(run_dir, cfg.run.name)
        return cls(run_dir, cfg, summary, _json(run_dir / "metrics.json") or {}, recent, tokens)

    # --- the episode source the transcript routes read --------------------------------------------------
    async def find(self, episode_id: str) -> dict[str, Any] | None:
        rec = self.recent.get(episode_id) or await asyncio.to_thread(
            archive_find, self.dir / ARCHIVE_NAME, self.dir / INDEX_NAME, episode_id)
        if rec is None:
            return None
        return {k: v for k, v in rec.items() if k != "reply_tokens"}

    async def tokens(self, episode_id: str) -> dict[str, Any] | None:
        if episode_id in self.held_tokens:
            return self.held_tokens[episode_id]
        rec = await asyncio.to_thread(archive_find, self.dir / ARCHIVE_NAME, self.dir / INDEX_NAME, episode_id)
        return (rec or {}).get("reply_tokens")

    async def archived(self, keep: Callable[[dict[str, Any]], bool], offset: int, limit: int
                       ) -> tuple[int, list[dict[str, Any]]]:
        return await asyncio.to_thread(archive_page, self.dir / ARCHIVE_NAME, self.dir / INDEX_NAME, keep,
                                       offset, limit)

    # --- what the live routes would say -----------------------------------------------------------------
    def started_at(self) -> float:
        times = [s["time"] for m in self.metrics.values() for s in m.get("train_steps", []) if s.get("time")]
        times += [g[0] for m in self.metrics.values() for g in m.get("group_rewards", [])]
        return min(times, default=0.0)

    def status(self) -> dict[str, Any]:
        s, wall = self.summary, float(self.summary.get("wall_s") or 0.0)
        agents = {}
        for name, a in (s.get("agents") or {}).items():
            recent = [r for _, r in (self.metrics.get(name) or {}).get("group_rewards", [])[-16:]]
            agents[name] = {"step": a.get("steps", 0), "weight_version": a.get("last_weight_version", 0),
                            "recent_group_reward": sum(recent) / len(recent) if recent else None,
                            "eval_start": a.get("eval_start"), "eval_end": a.get("eval_end"),
                            "signal": a.get("signal"), "rollout": {}, "max_staleness": a.get("max_staleness")}
        return {"run": s.get("run"), "phase": s.get("phase", "done"), "paused": False, "error": s.get("error"),
                "uptime_s": wall, "episodes": s.get("episodes", 0),
                "episodes_per_s": s.get("episodes", 0) / wall if wall else 0.0,
                "episodes_failed": s.get("episodes_failed") or {}, "total_steps": self.cfg.run.total_steps,
                "agents": agents, "evals": s.get("evals") or [], "read_only": True}

    def pipeline(self) -> dict[str, Any]:
        gates = {name: {"blocked": False, "claimed": 0, "limit": "-", "max_staleness": a.get("max_staleness"),
                        "groups": {"kept": a.get("groups_kept"), "dropped": a.get("groups_dropped"),
                                   "abandoned": a.get("groups_abandoned"), "in_flight": 0},
                        "abandon_reasons": a.get("abandon_reasons") or {}}
                 for name, a in (self.summary.get("agents") or {}).items()}
        return {"gates": gates, "services": []}

    def tokenizer_for(self) -> Callable[[Player], Any]:
        from services.common.tokens import load_tokenizer

        cache: dict[str, Any] = {}

        def get(player: Player) -> Any:
            path = player.path if isinstance(player, Local) else (
                self.cfg.agents[player.agent].model_path if isinstance(player, AgentPlayer)
                and player.agent in self.cfg.agents else None)
            if path is None:
                return None
            if path not in cache:
                cache[path] = None
                with contextlib.suppress(Exception):  # weights gone since: the page shows token ids
                    cache[path] = load_tokenizer(path)
            return cache[path]
        return get


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def build_app(run: FinishedRun, static: Path) -> FastAPI:
    """The read-only dashboard of ``run``: the page, its data routes, and 405 for every control."""
    app = FastAPI(title=f"Tandem dashboard: {run.cfg.run.name} (finished, read-only)")
    app.mount("/dashboard/static", StaticFiles(directory=static), name="dashboard-static")
    env_cls = load_environment(run.cfg.environment.name)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(static / "index.html", headers=NO_CACHE)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/dashboard/info")
    async def info() -> dict[str, Any]:
        return run_info(run.cfg, env_cls) | {"token_required": False, "started_at": run.started_at(),
                                             "read_only": True}

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return run.status()

    @app.get("/v1/metrics")
    async def metrics() -> dict[str, Any]:
        return run.metrics

    @app.get("/v1/dashboard/pipeline")
    async def pipeline() -> dict[str, Any]:
        return run.pipeline()

    async def refuse() -> JSONResponse:
        return JSONResponse({"detail": "read-only: this is a finished run's dashboard (tandem dashboard)"}, 405)

    for name in CONTROLS:
        app.post(f"/v1/{name}")(refuse)
    episode_routes(app, run.cfg, env_cls, run, run.tokenizer_for(), [])
    return app
