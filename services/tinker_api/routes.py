"""The Tinker API's routes in four groups (docs/architecture.md §12): service, session, training, sampling.

Each group is an ``APIRouter`` built from the server's config and a getter for the running
``TinkerService`` (made in the app's lifespan). Training and sampling routes answer at once
with a future (``request_id``) that the SDK long-polls on ``/api/v1/retrieve_future``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from services.tinker_api import wire
from services.tinker_api.config import ServeConfig
from services.tinker_api.losses import Conflict, UserError
from services.tinker_api.service import JSON, PROTO, TinkerService

M = TypeVar("M", bound=BaseModel)
Svc = Callable[[], TinkerService]
LONG_POLL_S = 20.0
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                 "sample_use_retrieve_futures": False, "custom_loss_server_side": True,
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


async def submitted(svc: TinkerService, kind: str, body: bytes, proto: bool, submit: Any) -> dict[str, Any]:
    """Run ``submit()``; a request it refuses still takes its ``seq_id`` (as a failed operation), so the
    model's later requests are not left waiting behind it; the refusal is then raised as usual."""
    try:
        return await submit()
    except UserError as exc:
        ref = wire.sequence_ref(body, proto)
        if ref is not None and not isinstance(exc, Conflict):
            await svc.refuse_op(kind, ref[0], ref[1], body, PROTO if proto else JSON, str(exc))
        raise


def service_routes(cfg: ServeConfig, svc: Svc) -> APIRouter:
    """Health, capabilities, the SDK's client config and telemetry."""
    r = APIRouter()

    @r.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        await svc().store.ping()
        return {"status": "ok"}

    @r.get("/health")
    async def health() -> dict[str, Any]:  # what Tandem's container HEALTHCHECK and probes ask
        await svc().store.ping()
        return {"service": "tinker_api", "ok": True, **svc().loaded()}

    @r.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        names = sorted({*cfg.models, *cfg.base_models, *(h.path for h in svc().workshop.hosts.values())})
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True} for n in names]}

    @r.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return {**CLIENT_CONFIG, "pjwt_auth_enabled": cfg.jwt_auth}

    @r.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return {"sample_cancel_enabled": False}

    @r.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict[str, str]:
        try:
            events = json.loads(await request.body() or b"{}").get("events", [])
        except (ValueError, AttributeError):
            events = []
        await svc().store.count("events", len(events) if isinstance(events, list) else 0)
        return {"status": "accepted"}

    return r


def session_routes(svc: Svc) -> APIRouter:
    """Sessions: create, heartbeat, finish."""
    r = APIRouter()

    @r.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        req = parse(wire.CreateSession, await request.body())
        sid = uuid.uuid4().hex
        await svc().store.put("session", sid, {"tags": req.tags, "user_metadata": req.user_metadata,
                                               "sdk_version": req.sdk_version, "project_id": req.project_id,
                                               "display_name": req.display_name, "created": time.time()})
        return {"type": "create_session", "session_id": sid}

    @r.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        req = parse(wire.SessionRef, await request.body())
        if await svc().store.get("session", req.session_id) is None:
            return user_error(f"session_id: unknown session {req.session_id!r}", 404)
        if await svc().store.field("session", req.session_id, "finished") is not None:
            return user_error(f"session {req.session_id} has finished", 410)
        await svc().store.touch("session", req.session_id, "heartbeat", str(time.time()))
        return {"type": "session_heartbeat"}

    @r.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> Any:
        if await svc().store.get("session", session_id) is None:
            return user_error(f"session_id: unknown session {session_id!r}", 404)
        await svc().store.touch("session", session_id, "finished", (await request.body()).decode() or "{}")
        await svc().finish_session(session_id)
        return {}

    return r


def model_routes(svc: Svc) -> APIRouter:
    """Models: create, info, and the loads (into a model, or creating one from a saved state)."""
    r = APIRouter()

    @r.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        rid, model_id = await svc().create_model(parse(wire.CreateModel, await request.body()))
        return {"request_id": rid, "model_id": model_id}

    @r.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        req = parse(wire.ModelRef, await request.body())
        spec = await svc().store.get("model", req.model_id)
        if spec is None:
            raise UserError(f"model_id: unknown model {req.model_id!r}")
        base = spec["base_model"]
        try:  # the SDK loads its tokenizer from tokenizer_id: the local directory, also under a hub name
            tokenizer = svc().local_dir(base)
        except UserError:
            tokenizer = base
        return {"type": "get_info", "model_id": req.model_id, "is_lora": True, "lora_rank": spec["rank"],
                "model_name": base, "model_data": {"arch": "causal_lm", "model_name": base, "tokenizer_id": tokenizer}}

    @r.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        body = await request.body()

        async def submit() -> dict[str, Any]:
            req = parse(wire.LoadWeights, body)
            if req.model_id is not None:
                if req.seq_id is None or req.seq_id < 1:
                    raise UserError("seq_id: a load into a model needs its seq_id (1 or more)")
                rid = await svc().submit_op("load_weights", req.model_id, req.seq_id, body)
                return {"request_id": rid, "model_id": req.model_id}
            rid, model_id = await svc().load_create(req)
            return {"request_id": rid, "model_id": model_id}

        return await submitted(svc(), "load_weights", body, False, submit)

    return r


def training_routes(svc: Svc) -> APIRouter:
    """forward_backward (protobuf), optim_step and the saves: each is one op in its model's seq order."""
    r = APIRouter()

    @r.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        body = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            import zstandard

            body = zstandard.ZstdDecompressor().decompress(body)

        async def submit() -> dict[str, Any]:
            model_id, seq, _, _, _, _ = wire.decode_forward_backward(body)
            if seq < 1:
                raise UserError("seq_id: must be 1 or more")
            await svc().custom_loss(model_id, body)  # a custom loss it names is this session's
            rid = await svc().submit_op("forward_backward", model_id, seq, body, PROTO)
            return {"request_id": rid, "model_id": model_id}

        return await submitted(svc(), "forward_backward", body, True, submit)

    @r.post("/api/v1/create_custom_loss")
    async def create_custom_loss(request: Request) -> dict[str, Any]:
        body = await request.body()
        return {"request_id": await svc().create_custom_loss(parse(wire.CreateCustomLoss, body), body)}

    async def model_op(kind: str, request: Request, model: type[M]) -> dict[str, Any]:
        body = await request.body()

        async def submit() -> dict[str, Any]:
            req: Any = parse(model, body)
            rid = await svc().submit_op(kind, req.model_id, req.seq_id, body)
            return {"request_id": rid, "model_id": req.model_id}

        return await submitted(svc(), kind, body, False, submit)

    @r.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return await model_op("optim_step", request, wire.OptimStep)

    @r.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return await model_op("save_weights", request, wire.SaveWeights)

    @r.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return await model_op("save_for_sampler", request, wire.SaveWeights)

    @r.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, Any]:
        return await model_op("save_external", request, wire.SaveExternal)

    return r


def sampling_routes(svc: Svc) -> APIRouter:
    """Sampling sessions, ``asample``, and the futures of every route (``retrieve_future``)."""
    r = APIRouter()

    @r.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        sid = await svc().create_sampling_session(parse(wire.CreateSamplingSession, await request.body()))
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @r.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> Any:
        rec = await svc().store.get("sampler", sampler_id)
        if rec is None:
            return user_error(f"sampler_id: unknown sampling session {sampler_id!r}", 404)
        return {"sampler_id": sampler_id, "base_model": rec["base_model"], "model_path": rec.get("model_path")}

    @r.post("/api/v1/join_sampling_session")
    async def join_sampling_session(request: Request) -> dict[str, Any]:
        sid = parse(wire.SamplerRef, await request.body()).sampling_session_id
        if await svc().store.get("sampler", sid) is None:
            raise UserError(f"sampling_session_id: unknown sampling session {sid!r}")
        return {"type": "join_sampling_session", "client_counter": await svc().store.count(f"clones:{sid}")}

    @r.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await request.body()
        rid, ids = await svc().submit_sample(parse(wire.Sample, body), body)
        return {"request_id": rid, "sample_sequence_ids": ids}

    @r.post("/api/v1/cancel_future")
    async def cancel_future() -> dict[str, Any]:
        return {}

    @r.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        req = parse(wire.FutureRef, await request.body())
        rec = await svc().result(req.request_id, LONG_POLL_S)
        if rec is None:
            return user_error(f"request_id: unknown request {req.request_id!r}", 404)
        if rec.get("state") == b"pending":
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        return Response(rec["result"], media_type=rec.get("rctype", JSON.encode()).decode())

    return r


def unserved_routes(svc: Svc) -> APIRouter:
    """Any other path: a 404 in the SDK's error shape; a model operation sent there still takes its seq_id."""
    r = APIRouter()

    @r.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unserved(path: str, request: Request) -> JSONResponse:
        message = f"{request.method} /{path} is not served by this Tandem server"
        if request.method != "GET":
            body = await request.body()
            ref = wire.sequence_ref(body, request.headers.get("content-type", "").startswith(PROTO))
            if ref is not None:
                await svc().refuse_op(f"unserved:/{path}", ref[0], ref[1], body, JSON, message)
        return user_error(message, 404)

    return r
