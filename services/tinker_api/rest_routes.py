"""The SDK's ``RestClient`` routes (docs/architecture.md §12): training runs, checkpoints, and getting weights out.

Training runs are the service's models; their checkpoints are directories under
``data_dir/runs`` (``checkpoints.py``). An external-weights checkpoint's files are fetched
through signed URLs (``/api/v1/files/...?expires=&sig=``), which need no API key: the
signature is the credential, and it names one file for one hour (so is a session's exported
trace, ``files/traces/...``).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from services.tinker_api import checkpoints as ck
from services.tinker_api import wire
from services.tinker_api.losses import UserError
from services.tinker_api.routes import Svc, parse, user_error
from services.tinker_api.session_trace import TRACES

FILES_PREFIX = "/api/v1/files/"


def _page(items: list[Any], limit: int, offset: int) -> tuple[list[Any], dict[str, int]]:
    if limit < 1 or offset < 0:
        raise UserError("limit must be 1 or more and offset 0 or more")
    return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


class Catalog:
    """What the REST routes read: the models' records (Redis) and their checkpoint directories."""

    def __init__(self, svc: Svc) -> None:
        self.svc = svc

    @property
    def runs(self) -> Path:
        return self.svc().workshop.runs

    async def checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        expiry, public = await self.svc().store.expiries(), await self.svc().store.public()

        def scan() -> list[dict[str, Any]]:
            return [ck.describe(model_id, kind, d, expiry.get(path := f"tinker://{model_id}/{kind}/{d.name}"),
                                path in public) for kind, d in ck.checkpoint_dirs(self.runs, model_id)]

        return await asyncio.to_thread(scan)

    async def run(self, model_id: str) -> dict[str, Any] | None:
        spec = await self.svc().store.get("model", model_id)
        if spec is None:
            return None
        cps = await self.checkpoints(model_id)
        last = {t: next((c for c in reversed(cps) if c["checkpoint_type"] == t), None) for t in ("training", "sampler")}
        return {"training_run_id": model_id, "base_model": spec["base_model"], "model_owner": spec["session_id"],
                "is_lora": True, "lora_rank": spec["rank"], "last_request_time": _iso(spec.get("created", 0.0)),
                "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
                "user_metadata": {k: str(v) for k, v in (spec.get("user_metadata") or {}).items()}}

    async def checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        path = f"tinker://{model_id}/{kind}/{name}"
        ck.parse_path(path)
        return await asyncio.to_thread(self.svc().workshop.resolve, path, kind)


def rest_routes(svc: Svc) -> APIRouter:
    """Runs, checkpoints, weights info, signed file URLs, deletes and TTLs."""
    r = APIRouter()
    cat = Catalog(svc)

    @r.get("/api/v1/training_runs")
    async def list_training_runs(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        ids = await svc().store.names("model")
        page, cursor = _page(ids, limit, offset)
        return {"training_runs": [x for m in page if (x := await cat.run(m)) is not None], "cursor": cursor}

    @r.get("/api/v1/training_runs/{model_id}")
    async def training_run(model_id: str) -> Any:  # the cookbook reads a checkpoint's renderer name here
        run = await cat.run(model_id)
        return run if run is not None else user_error(f"training_run_id: unknown training run {model_id!r}", 404)

    @r.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str) -> Any:
        if await svc().store.get("model", model_id) is None:
            return user_error(f"training_run_id: unknown training run {model_id!r}", 404)
        return {"checkpoints": await cat.checkpoints(model_id)}

    @r.get("/api/v1/checkpoints")
    async def list_user_checkpoints(limit: int = 100, offset: int = 0) -> dict[str, Any]:
        every = [c for m in await svc().store.names("model") for c in await cat.checkpoints(m)]
        page, cursor = _page(every, limit, offset)
        return {"checkpoints": page, "cursor": cursor}

    @r.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        path = parse(wire.WeightsInfoRequest, await request.body()).tinker_path
        model_id, kind, name = ck.parse_path(path)
        await cat.checkpoint_dir(model_id, kind, name)
        spec = await svc().store.get("model", model_id)
        if spec is None:
            raise UserError(f"tinker_path: unknown training run {model_id!r}")
        return {"base_model": spec["base_model"], "is_lora": True, "lora_rank": spec["rank"],
                "train_unembed": spec["train_unembed"], "train_mlp": spec["train_mlp"],
                "train_attn": spec["train_attn"]}

    file_routes(r, svc, cat)
    checkpoint_lifetime_routes(r, svc, cat)
    return r


def file_routes(r: APIRouter, svc: Svc, cat: Catalog) -> None:
    """Signed URLs to an external-weights checkpoint's files, and the files (or a session's trace) behind them."""

    @r.get("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/external_weights_urls")
    async def external_weights_urls(model_id: str, kind: str, name: str, request: Request) -> dict[str, Any]:
        if kind != "external_weights":
            raise UserError(f"checkpoint {kind}/{name}: signed file URLs are for external_weights checkpoints")
        root = await cat.checkpoint_dir(model_id, kind, name)
        files = await asyncio.to_thread(lambda: sorted(f.relative_to(root).as_posix() for f in root.rglob("*")
                                                       if f.is_file()))
        signer, base = svc().signer, str(request.base_url)
        urls = {f: signer.url(base, f"{model_id}/{kind}/{name}/{f}")[0] for f in files}
        return {"urls": urls, "expires": _iso(signer.url(base, "")[1])}

    @r.get(FILES_PREFIX + "{rel:path}")
    async def signed_file(rel: str, expires: int, sig: str) -> Any:
        svc().signer.check(rel, expires, sig)
        if rel.startswith(TRACES + "/"):  # a session's exported trace
            target = cat.runs.parent / rel
            if "/" in rel[len(TRACES) + 1:] or not target.is_file():
                return user_error(f"no file {rel!r}", 404)
            return FileResponse(target, media_type="application/json")
        model_id, kind, name, *rest = rel.split("/")
        root = await cat.checkpoint_dir(model_id, kind, name)
        target = (root / "/".join(rest)).resolve()
        if not rest or not target.is_relative_to(root.resolve()) or not target.is_file():
            return user_error(f"no file {rel!r}", 404)
        return FileResponse(target)


def checkpoint_lifetime_routes(r: APIRouter, svc: Svc, cat: Catalog) -> None:
    """A checkpoint deleted, or given a TTL (an expired checkpoint is deleted by the reaper)."""

    @r.delete("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(model_id: str, kind: str, name: str) -> dict[str, Any]:
        root = await cat.checkpoint_dir(model_id, kind, name)
        await asyncio.to_thread(shutil.rmtree, root, True)
        await svc().samplers.forget([str(root)])
        await svc().store.set_expiry(f"tinker://{model_id}/{kind}/{name}", None)
        await svc().store.set_public(f"tinker://{model_id}/{kind}/{name}", False)
        return {}

    @r.put("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(model_id: str, kind: str, name: str, request: Request) -> dict[str, Any]:
        ttl = parse(wire.CheckpointTtl, await request.body()).ttl_seconds
        await cat.checkpoint_dir(model_id, kind, name)
        at = None if ttl is None else time.time() + ttl
        await svc().store.set_expiry(f"tinker://{model_id}/{kind}/{name}", at)
        return {}

