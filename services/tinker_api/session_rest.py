"""The SDK's session and sharing routes (docs/architecture.md §12): sessions read and searched, projects,
checkpoint storage by project, published checkpoints, and copies of weights.

A session's record (Redis, ``tk:session:{id}``) holds what ``create_session`` sent (user
metadata, display name, project) and when it last beat and finished; its training runs and
sampling sessions are the models and samplers it created. There is one identity here (no
accounts), so "own" and "accessible" sessions are all of them. A session's trace is its recorded
requests (``session_trace.py``). A published checkpoint is a
flag on its listing. ``copy_weights`` makes a new session holding one training run (which
cannot be trained: it has no operation log) whose checkpoint shares the source's files (hard
links).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Request

from services.tinker_api import checkpoints as ck
from services.tinker_api import wire
from services.tinker_api.losses import UserError
from services.tinker_api.routes import Svc, parse, user_error
from services.tinker_api.session_trace import write_trace

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ACTIVE_S = 120.0  # a session that beat (or was created) this recently counts as running
DEFAULT_PROJECT = "default"


def _order(created_at: datetime, session_id: str) -> tuple[int, str]:
    """Newest first, then by id: the search's order, in whole microseconds (what its cursor carries)."""
    return -((created_at - EPOCH) // timedelta(microseconds=1)), session_id


def _created(rec: dict[str, Any]) -> datetime:
    return datetime.fromtimestamp(rec.get("created", 0.0), UTC)


def _status(rec: dict[str, Any], finished: str | None, beat: str | None) -> dict[str, Any] | None:
    """``SessionStatus``: finished by its client, cancelled (expired for want of heartbeats), active, or None."""
    if finished is not None:
        if "expired" in finished:
            return {"type": "cancelled", "detail": "expired: no heartbeat"}
        return {"type": "client_finished", "reason": {"type": "success"}}
    last = max(float(beat or 0.0), float(rec.get("created", 0.0)))
    return {"type": "active"} if time.time() - last < ACTIVE_S else None


class Sessions:
    """Sessions as the SDK reads them, from the service's records."""

    def __init__(self, svc: Svc) -> None:
        self.svc = svc

    async def record(self, session_id: str) -> dict[str, Any]:
        rec = await self.svc().store.get("session", session_id)
        if rec is None:
            raise LookupError(session_id)
        return rec

    async def newest_first(self) -> list[tuple[str, dict[str, Any]]]:
        store = self.svc().store
        found = [(sid, rec) for sid in await store.names("session") if (rec := await store.get("session", sid))]
        return sorted(found, key=lambda x: _order(_created(x[1]), x[0]))

    async def members(self, kind: str, session_id: str) -> list[str]:
        return [n for n in await self.svc().store.names(kind) if n.startswith(f"{session_id}:")]

    async def summary(self, session_id: str, rec: dict[str, Any]) -> dict[str, Any]:
        store, runs = self.svc().store, self.svc().workshop.runs
        models = await self.members("model", session_id)
        cps = await asyncio.to_thread(lambda: [d for m in models for _, d in ck.checkpoint_dirs(runs, m)])
        size = await asyncio.to_thread(lambda: sum(ck.dir_size(d) for d in cps))
        return {"session_id": session_id, "created_at": _created(rec).isoformat(),
                "owner": "local", "project_id": rec.get("project_id") or DEFAULT_PROJECT,
                "status": _status(rec, await store.field("session", session_id, "finished"),
                                  await store.field("session", session_id, "heartbeat")),
                "checkpoints_count": len(cps), "display_name": rec.get("display_name"),
                "user_metadata": _str_map(rec.get("user_metadata")), "checkpoint_storage_bytes": size}


def _str_map(meta: Any) -> dict[str, str] | None:
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else None


def _matches(req: wire.SessionSearch, sid: str, summary: dict[str, Any]) -> bool:
    named = [x for x in (req.session_id is not None and sid == req.session_id,
                         req.display_name is not None and all(
                             w in (summary["display_name"] or "").lower() for w in req.display_name.lower().split()))
             if x is not False]
    if (req.session_id is not None or req.display_name is not None) and not named:
        return False
    if req.project_ids is not None and summary["project_id"] not in req.project_ids:
        return False
    meta = summary["user_metadata"] or {}
    if any(meta.get(k) != v for k, v in req.user_metadata.items()):
        return False
    status = (summary["status"] or {}).get("type")
    return req.statuses is None or status in {s.get("type") for s in req.statuses}


def session_rest_routes(svc: Svc) -> APIRouter:
    r = APIRouter()
    sessions = Sessions(svc)

    @r.get("/api/v1/sessions")
    async def list_sessions(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        if limit < 1 or offset < 0:
            raise UserError("limit must be 1 or more and offset 0 or more")
        return {"sessions": [sid for sid, _ in (await sessions.newest_first())[offset:offset + limit]]}

    @r.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str) -> Any:
        try:
            rec = await sessions.record(session_id)
        except LookupError:
            return user_error(f"session_id: unknown session {session_id!r}", 404)
        return {"training_run_ids": await sessions.members("model", session_id),
                "sampler_ids": await sessions.members("sampler", session_id),
                "user_metadata": _str_map(rec.get("user_metadata")), "display_name": rec.get("display_name")}

    @r.get("/api/v1/sessions/{session_id}/trace_export")
    async def trace_export(session_id: str, request: Request) -> Any:
        try:
            await sessions.record(session_id)
        except LookupError:
            return user_error(f"session_id: unknown session {session_id!r}", 404)
        requests = await svc().store.session_requests(session_id)
        rel = await asyncio.to_thread(write_trace, svc().workshop.runs.parent, session_id, requests)
        return {"status": "ready", "url": svc().signer.url(str(request.base_url), rel)[0]}

    @r.put("/api/v1/sessions/{session_id}/project")
    async def assign_project(session_id: str, request: Request) -> Any:
        project = parse(wire.SessionProject, await request.body()).project_id
        try:
            rec = await sessions.record(session_id)
        except LookupError:
            return user_error(f"session_id: unknown session {session_id!r}", 404)
        await svc().store.put("session", session_id, {**rec, "project_id": project})
        return None

    search_routes(r, sessions)
    publish_routes(r, svc)
    copy_routes(r, svc)
    return r


def search_routes(r: APIRouter, sessions: Sessions) -> None:
    """Sessions searched (filters, newest first, cursor paging), and the checkpoint storage they hold."""

    @r.post("/api/v1/sessions/search")
    async def search_sessions(request: Request) -> dict[str, Any]:
        req = parse(wire.SessionSearch, await request.body())
        if req.owner.get("type") == "user" and "local" not in req.owner.get("owner_urns", []):
            return {"sessions": [], "next_cursor": None}
        after = req.cursor and _order(datetime.fromisoformat(req.cursor["last_created_at"]),
                                      req.cursor["last_session_id"])
        page: list[dict[str, Any]] = []
        for sid, rec in await sessions.newest_first():
            if after and _order(_created(rec), sid) <= after:
                continue
            summary = await sessions.summary(sid, rec)
            if _matches(req, sid, summary):
                page.append(summary)
            if len(page) > req.limit:
                break
        more = len(page) > req.limit
        page = page[:req.limit]
        cursor = {"last_created_at": page[-1]["created_at"], "last_session_id": page[-1]["session_id"]}
        return {"sessions": page, "next_cursor": cursor if more else None}

    @r.get("/api/v1/billing/usage/checkpoints/current")
    async def checkpoint_storage(project_id: str | None = None) -> dict[str, Any]:
        """The live checkpoints' count and bytes, by their session's project (no cost: no billing here)."""
        groups: dict[str, list[int]] = {}
        for sid, rec in await sessions.newest_first():
            summary = await sessions.summary(sid, rec)
            if project_id is None or summary["project_id"] == project_id:
                group = groups.setdefault(summary["project_id"], [0, 0])
                group[0] += summary["checkpoints_count"]
                group[1] += summary["checkpoint_storage_bytes"]
        return {"effective_rate_usd_per_gigabyte_month": None,
                "data": [{"project_id": p, "org_user_urn": "local", "checkpoint_count": n, "size_bytes": b,
                          "size_gigabytes": b / 1e9} for p, (n, b) in sorted(groups.items()) if n]}


def publish_routes(r: APIRouter, svc: Svc) -> None:
    """POST publishes a checkpoint (its listing says ``public``), DELETE unpublishes it."""

    async def flag(model_id: str, kind: str, name: str, on: bool) -> None:
        path = f"tinker://{model_id}/{kind}/{name}"
        await asyncio.to_thread(svc().workshop.resolve, path, kind)
        await svc().store.set_public(path, on)

    @r.post("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/publish")
    async def publish(model_id: str, kind: str, name: str) -> None:
        await flag(model_id, kind, name, True)

    @r.delete("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/publish")
    async def unpublish(model_id: str, kind: str, name: str) -> None:
        await flag(model_id, kind, name, False)


def copy_routes(r: APIRouter, svc: Svc) -> None:
    @r.post("/api/v1/copy_weights")
    async def copy_weights(request: Request) -> dict[str, Any]:
        req = parse(wire.CopyWeights, await request.body())
        key = request.headers.get("x-idempotency-key")
        if key and (seen := await svc().store.get("copy", key)) is not None:
            return {"tinker_path": seen["tinker_path"]}
        if req.ttl_seconds is not None and not 3600 <= req.ttl_seconds <= 10 * 365 * 86400:
            raise UserError("ttl_seconds: between 1 hour (3600) and 10 years")
        model_id, kind, name = ck.parse_path(req.source_path)
        src = await asyncio.to_thread(svc().workshop.resolve, req.source_path, kind)
        spec = await svc().store.get("model", model_id)
        if spec is None:
            raise UserError(f"source_path: unknown training run {model_id!r}")
        session_id, seq = await _copy_owner(svc, req)
        new_id = f"{session_id}:train:{seq}"
        if not await svc().store.put("model", new_id, {**spec, "session_id": session_id, "created": time.time(),
                                                       "copied_from": req.source_path}, only_new=True):
            raise UserError(f"model_seq_id: {new_id} already exists")
        dst = svc().workshop.local_dir(new_id, kind, name)
        await asyncio.to_thread(_link_tree, src, dst)
        path = f"tinker://{new_id}/{kind}/{name}"
        if req.ttl_seconds is not None:
            await svc().store.set_expiry(path, time.time() + req.ttl_seconds)
        if key:
            await svc().store.put("copy", key, {"tinker_path": path})
        return {"tinker_path": path}


async def _copy_owner(svc: Svc, req: wire.CopyWeights) -> tuple[str, int]:
    """(session, model_seq_id) the copy goes in: the one named, or a new session in the destination project."""
    if req.session_id is not None:
        if req.model_seq_id is None or await svc().store.get("session", req.session_id) is None:
            raise UserError("session_id: give a known session and its model_seq_id")
        return req.session_id, req.model_seq_id
    if not req.destination_project_id:
        raise UserError("copy_weights: give destination_project_id, or session_id and model_seq_id")
    sid = uuid.uuid4().hex
    await svc().store.put("session", sid, {"tags": ["copy_weights"], "user_metadata": {}, "sdk_version": "",
                                           "project_id": req.destination_project_id, "created": time.time()})
    await svc().store.touch("session", sid, "finished", "{}")
    return sid, 0


def _link_tree(src: Any, dst: Any) -> None:
    """The checkpoint's files, hard-linked (no bytes copied; a copy where links are not possible)."""
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, tmp, copy_function=link)
    os.replace(tmp, dst)
