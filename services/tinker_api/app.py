"""The HTTP face of the Tinker API service: the routes the official SDK (0.38) calls.

Every training or sampling call answers at once with a future (``request_id``); the SDK
long-polls ``/api/v1/retrieve_future`` for its result. A bad request is answered 400 with
``{"error", "detail", "category": "user"}``; a failed future carries the same
``{"error", "category"}``. With ``api_keys`` set, every route but the health checks needs one of
them in ``X-API-Key`` (the SDK sends its ``TINKER_API_KEY`` there).
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from services.tinker_api import wire
from services.tinker_api.config import ServeConfig
from services.tinker_api.losses import UserError
from services.tinker_api.service import JSON, PROTO, TinkerService
from services.tinker_api.store import Store

M = TypeVar("M", bound=BaseModel)
LONG_POLL_S = 20.0
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                 "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                 "sample_join_sampling_session": False, "parallel_fwdbwd_chunks": True}


def parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise UserError(f"{where}: {first['msg']}") from None


def user_error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message, "detail": message, "category": "user"}, status_code=status)


def create_app(cfg: ServeConfig, redis_url: str) -> FastAPI:
    svc_holder: dict[str, TinkerService] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        store = Store(redis_url)
        await store.ping()
        svc = TinkerService(store, cfg.data_dir, cfg.sampler_cache, cfg.resolved_device())
        svc_holder["svc"] = svc
        await svc.recover()
        try:
            yield
        finally:
            await svc.close()
            await store.close()

    app = FastAPI(title="Tandem Tinker API", lifespan=lifespan)

    def svc() -> TinkerService:
        return svc_holder["svc"]

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        keys = cfg.api_keys
        open_path = request.url.path in ("/api/v1/healthz", "/health")
        given = (request.headers.get("x-api-key") or "").encode()
        if keys and not open_path and not any(hmac.compare_digest(given, k.encode()) for k in keys):
            return user_error("X-API-Key: missing or not one of this server's API keys", 401)
        try:
            return await call_next(request)
        except UserError as exc:
            return user_error(str(exc))

    @app.exception_handler(UserError)
    async def on_user_error(_: Request, exc: UserError) -> JSONResponse:
        return user_error(str(exc))

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        message = f"internal error: {type(exc).__name__}: {exc}"
        return JSONResponse({"error": message, "detail": message, "category": "server"}, status_code=500)

    # -- service and session ------------------------------------------------------------
    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        await svc().store.ping()
        return {"status": "ok"}

    @app.get("/health")
    async def health() -> dict[str, Any]:  # what Tandem's container HEALTHCHECK and probes ask
        await svc().store.ping()
        return {"service": "tinker_api", "ok": True}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        names = sorted({*cfg.base_models, *(h.path for h in svc().workshop.hosts.values())})
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True} for n in names]}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return {"sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict[str, str]:
        try:
            events = json.loads(await request.body() or b"{}").get("events", [])
        except (ValueError, AttributeError):
            events = []
        await svc().store.count("events", len(events) if isinstance(events, list) else 0)
        return {"status": "accepted"}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        req = parse(wire.CreateSession, await request.body())
        sid = uuid.uuid4().hex
        await svc().store.put("session", sid, {"tags": req.tags, "user_metadata": req.user_metadata,
                                               "sdk_version": req.sdk_version})
        return {"type": "create_session", "session_id": sid}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        req = parse(wire.SessionRef, await request.body())
        if await svc().store.get("session", req.session_id) is None:
            return user_error(f"session_id: unknown session {req.session_id!r}", 404)
        if await svc().store.field("session", req.session_id, "finished") is not None:
            return user_error(f"session {req.session_id} has finished", 410)
        await svc().store.touch("session", req.session_id, "heartbeat", str(time.time()))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> Any:
        if await svc().store.get("session", session_id) is None:
            return user_error(f"session_id: unknown session {session_id!r}", 404)
        await svc().store.touch("session", session_id, "finished", (await request.body()).decode() or "{}")
        await svc().finish_session(session_id)
        return {}

    # -- models and training ------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        rid, model_id = await svc().create_model(parse(wire.CreateModel, await request.body()))
        return {"request_id": rid, "model_id": model_id}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        req = parse(wire.ModelRef, await request.body())
        spec = await svc().store.get("model", req.model_id)
        if spec is None:
            raise UserError(f"model_id: unknown model {req.model_id!r}")
        base = spec["base_model"]
        return {"type": "get_info", "model_id": req.model_id, "is_lora": True, "lora_rank": spec["rank"],
                "model_name": base, "model_data": {"arch": "causal_lm", "model_name": base, "tokenizer_id": base}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        body = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            import zstandard

            body = zstandard.ZstdDecompressor().decompress(body)
        model_id, seq, _, _, _, _ = wire.decode_forward_backward(body)
        if seq < 1:
            raise UserError("seq_id: must be 1 or more")
        rid = await svc().submit_op("forward_backward", model_id, seq, body, PROTO)
        return {"request_id": rid, "model_id": model_id}

    async def model_op(kind: str, request: Request, model: type[M]) -> dict[str, Any]:
        body = await request.body()
        req: Any = parse(model, body)
        rid = await svc().submit_op(kind, req.model_id, req.seq_id, body)
        return {"request_id": rid, "model_id": req.model_id}

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return await model_op("optim_step", request, wire.OptimStep)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return await model_op("save_weights", request, wire.SaveWeights)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return await model_op("save_for_sampler", request, wire.SaveWeights)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        body = await request.body()
        req = parse(wire.LoadWeights, body)
        if req.model_id is not None:
            if req.seq_id is None or req.seq_id < 1:
                raise UserError("seq_id: a load into a model needs its seq_id (1 or more)")
            rid = await svc().submit_op("load_weights", req.model_id, req.seq_id, body)
            return {"request_id": rid, "model_id": req.model_id}
        rid, model_id = await svc().load_create(req)
        return {"request_id": rid, "model_id": model_id}

    # -- sampling -----------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        sid = await svc().create_sampling_session(parse(wire.CreateSamplingSession, await request.body()))
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> Any:
        rec = await svc().store.get("sampler", sampler_id)
        if rec is None:
            return user_error(f"sampler_id: unknown sampling session {sampler_id!r}", 404)
        return {"sampler_id": sampler_id, "base_model": rec["base_model"], "model_path": rec.get("model_path")}

    @app.post("/api/v1/join_sampling_session")
    async def join_sampling_session(request: Request) -> dict[str, Any]:
        sid = parse(wire.SamplerRef, await request.body()).sampling_session_id
        if await svc().store.get("sampler", sid) is None:
            raise UserError(f"sampling_session_id: unknown sampling session {sid!r}")
        return {"type": "join_sampling_session", "client_counter": await svc().store.count(f"clones:{sid}")}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await request.body()
        rid, ids = await svc().submit_sample(parse(wire.Sample, body), body)
        return {"request_id": rid, "sample_sequence_ids": ids}

    @app.post("/api/v1/cancel_future")
    async def cancel_future() -> dict[str, Any]:
        return {}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        req = parse(wire.FutureRef, await request.body())
        rec = await svc().result(req.request_id, LONG_POLL_S)
        if rec is None:
            return user_error(f"request_id: unknown request {req.request_id!r}", 404)
        if rec.get("state") == b"pending":
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        return Response(rec["result"], media_type=rec.get("rctype", JSON.encode()).decode())

    return app
