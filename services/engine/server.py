"""The embedded engine's HTTP server: SGLang's native API (docs/architecture.md §5) over ``generator.Engine``.

``create_app(model_path, weight_version, max_batch, engine_id, admit_quiet_s, admit_window_s, admin_token,
device, dtype, engine_options)`` loads the model (on the CPU, or a GPU: ``embedded.device`` / ``embedded.dtype``)
and returns a FastAPI app serving ``/health``, ``/health_generate``,
``/get_model_info`` (+ ``/model_info``), ``/get_server_info`` (+ ``/server_info``),
``/get_load``, ``/generate``, ``/update_weights_from_disk``, ``/load_lora_adapter``,
``/unload_lora_adapter``, ``/get_weight_version``,
``/flush_cache``, ``/pause_generation``, ``/continue_generation`` and
``/abort_request``. The ``model_info``/``server_info`` aliases and ``/get_load``
are what the SGLang router (sglang-router 0.3.2) reads when it registers and
load-monitors a worker (see ``services/common/sglang_router.py``).

Bad input is answered 400 with SGLang's error object (``error_body``), never
a 500. The router adds a few SGLang fields of its own to every ``/generate``
body (``model``, ``log_metrics``, ``return_text_in_logprobs``...); those are
accepted when they ask for nothing this engine lacks, any other unknown
field is rejected. ``/generate`` itself (single and batch bodies, orjson in and out) is
``generate_api``; a call whose HTTP client disconnects before it is answered has its requests aborted (as
SGLang), so they free their batch slots. ``/get_server_info``'s ``internal_states`` carry the engine's counters
(prefills, decode steps, requests that joined or left a running batch, prompt tokens prefilled and taken
from the prefix cache, requests aborted as their client left, and the prefix cache's hits, misses, evictions
and size).

LoRA adapters (services/inference/adapters.py) load on the resident base under a name, and a ``/generate``
body's ``lora_path`` names the adapter a prompt runs under; unloading waits for the requests that name it.

The admin routes (``/update_weights_from_disk``, ``/load_lora_adapter``, ``/unload_lora_adapter``,
``/flush_cache``, ``/pause_generation``,
``/continue_generation``, ``/abort_request``) need the run's admin token as a bearer token
(``admin_token``: the rollout gives it through ``$TANDEM_ADMIN_TOKEN``, services/common/admin_token.py;
compared in constant time) and answer 401 otherwise; without a token they are closed to every caller.
Given the run's weights secret and its agent (``weights_secret``, ``agent``), the engine loads only a version
that agent's trainer signed (an adapter also one of the ``shared_with`` agents' trainers signed, named after
that agent: their rollouts share this engine), whatever token the caller holds: a load without the
signature, or whose files no longer match it, is answered 403 and the live model is kept
(``weights_auth.load_refusal``).
The health, info and ``/generate`` routes stay open to the router (docs/architecture.md §2.3).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.routing import Route

from services.common.admin_token import ADMIN_TOKEN_ENV, authorized
from services.common.weights_auth import WeightsProof, load_refusal
from services.contracts.sglang_api import (
    AbortReqInput,
    ContinueGenerationReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    PauseGenerationReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    error_body,
)
from services.engine.generate_api import (
    ROUTER_FIELDS,
    json_response,
    load_json,
    parse_generate,
    replies,
    validate,
    validation_message,
)
from services.inference.generator import Engine
from services.inference.request import EngineError, GenRequest

VERSION = "0.5.0-tandem-embedded"
# a step (one prefill or decode) still running after this long is taken as hung; a shorter one is progress (a
# real model's prefill of a full batch takes tens of seconds on a loaded CPU)
STEP_STALL_S = 300.0
_ROUTER_FIELDS = ROUTER_FIELDS  # the name the contract test reads
log = logging.getLogger("tandem.engine")


def _bad(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message, code), status_code=code)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """Parse a JSON body into ``model``; raise EngineError with the reason otherwise."""
    return validate(model, load_json(await request.body()))


class Unauthorized(Exception):
    """An admin route called without the engine's admin token."""


def create_app(model_path: str | Path, weight_version: int = 0, max_batch: int = 64,
               engine_id: str | None = None, admit_quiet_s: float = 0.002, admit_window_s: float = 0.02,
               admin_token: str | None = None, device: str = "cpu", dtype: str = "float32",
               weights_secret: bytes | None = None, agent: str | None = None, shared_with: tuple[str, ...] = (),
               engine_options: dict[str, Any] | None = None) -> FastAPI:
    engine = Engine(model_path, weight_version=weight_version, max_batch=max_batch,
                    admit_quiet_s=admit_quiet_s, admit_window_s=admit_window_s, device=device, dtype=dtype,
                    **(engine_options or {}))

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        yield
        engine.stop()

    app = FastAPI(title="Tandem embedded engine (SGLang API)", lifespan=lifespan)
    app.state.engine = engine
    _error_handlers(app)
    _info_routes(app, engine, str(Path(model_path).resolve()), engine_id)
    # /generate is a plain Starlette route: the hot path skips FastAPI's per-request dependency solving.
    app.router.routes.append(Route("/generate", _generate_endpoint(engine, engine_id), methods=["POST"]))
    signer = (weights_secret, (agent, *shared_with)) if weights_secret and agent else None
    _admin_routes(app, engine, admin_token, signer)
    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _bad(validation_message(exc))

    @app.exception_handler(EngineError)
    async def _on_engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return _bad(str(exc))

    @app.exception_handler(Unauthorized)
    async def _on_unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        resp = _bad(str(exc), 401)
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp


def _info_routes(app: FastAPI, engine: Engine, path: str, engine_id: str | None) -> None:
    """Health, model and server info, load and weight version: what the router and the rollout read."""

    def model_info() -> dict[str, Any]:
        return {"model_path": path, "tokenizer_path": path, "is_generation": True,
                "served_model_name": path, "weight_version": str(engine.weight_version),
                "preferred_sampling_params": None, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": engine.model.config.model_type,
                "architectures": list(engine.model.config.architectures or [])}

    def server_info() -> dict[str, Any]:
        return {**model_info(), "version": VERSION, "engine_id": engine_id, "max_batch": engine.max_batch,
                "max_running_requests": engine.max_batch, "context_length": engine.context_len,
                "tp_size": 1, "dp_size": 1, "load_balance_method": "round_robin",
                "disaggregation_mode": "null", "device": engine.device.type,
                "dtype": str(engine.model.dtype).removeprefix("torch."),
                "internal_states": [{"paused": engine.paused, **engine.load(), **engine.stats,
                                     "prefix_cache": {**engine.prefix.stats, "bytes": engine.prefix.nbytes,
                                                      "entries": len(engine.prefix)}}]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        # as SGLang: busy and making progress is healthy; "progress" follows the slowest recent step (a big
        # prefill of a slow model may take longer than 5 s), and a step still running counts up to STEP_STALL_S
        now, started = time.monotonic(), engine.step_started_at
        if engine.load()["num_reqs"] and (now - engine.last_step_at < engine.step_seconds.bound(5.0) or (
                started is not None and now - started < STEP_STALL_S)):
            return Response(status_code=200)
        req = GenRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=[engine.pad_id], temperature=0.0,
                         max_new_tokens=1)
        try:
            await asyncio.wait_for(engine.generate(req), timeout=engine.step_seconds.bound(30.0))
        except TimeoutError:
            return _bad("health generation timed out (engine paused or busy)", 503)
        return Response(status_code=200)

    app.get("/get_model_info")(model_info)
    app.get("/model_info")(model_info)
    app.get("/get_server_info")(server_info)
    app.get("/server_info")(server_info)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [{"dp_rank": 0, **engine.load()}]

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": str(engine.weight_version)}


def _generate_endpoint(engine: Engine, engine_id: str | None) -> Any:
    async def generate(request: Request) -> Response:
        call = parse_generate(await request.body(), engine)
        work = asyncio.ensure_future(engine.generate_many(call.requests))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping: the requests go with the call
            work.cancel()
            raise
        finally:
            gone.cancel()
        if not work.done():  # the client went away (its timeout): abort the call's requests, free their slots
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            engine.stats["client_aborts"] += len(call.requests)
            log.info("/generate client disconnected: aborted %d request(s) (%s)", len(call.requests),
                     ", ".join(r.rid for r in call.requests[:4]) + (" ..." if len(call.requests) > 4 else ""))
            return _bad("Request is disconnected from the client side: its requests were aborted")
        work.result()  # an EngineError raises here (answered 400)
        return json_response(replies(call, engine, engine_id))

    return generate


async def _client_gone(request: Request) -> None:
    """Return once the HTTP client has disconnected (its body is read: the next ASGI message is the disconnect).
    SGLang polls ``request.is_disconnected()`` every 4 s while a non-streaming request runs and aborts it; waiting
    on the message itself aborts at once."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.1)  # not expected once the body is read: never spin on a server that repeats one


def _admin_guard(admin_token: str | None) -> Any:
    def require_admin(authorization: str | None = Header(default=None)) -> None:
        if not admin_token:
            raise Unauthorized(f"admin routes are closed: this engine was started without an admin token "
                               f"(${ADMIN_TOKEN_ENV})")
        if not authorized(authorization, admin_token):
            raise Unauthorized("this route needs 'Authorization: Bearer <the run's admin token>'")

    return require_admin


Signer = tuple[bytes, tuple[str, ...]]  # the run's secret; this engine's agent, then the agents sharing it


def _own(signer: Signer) -> tuple[bytes, str]:
    """The run's secret and the engine's own agent (whose trainer alone may replace its full weights)."""
    return signer[0], signer[1][0]


def _admin_routes(app: FastAPI, engine: Engine, admin_token: str | None, signer: Signer | None) -> None:
    """Weight loading, cache, pause/continue and abort: the admin token's routes. With ``signer`` a load needs
    the trainer's signature (``weights_auth.load_refusal``): full weights the engine's own agent's only."""
    admin = [Depends(_admin_guard(admin_token))]
    @app.post("/update_weights_from_disk", dependencies=admin)
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body: UpdateWeightFromDiskReqInput = await _parse(request, UpdateWeightFromDiskReqInput)
        version: int | None = None
        if body.weight_version is not None:
            try:
                version = int(body.weight_version)
            except ValueError:
                raise EngineError(f"weight_version must be an integer, got {body.weight_version!r}") from None
        if signer is not None and (why := await asyncio.to_thread(
                load_refusal, *_own(signer), version, body.model_path, WeightsProof.from_headers(request.headers))):
            out = UpdateWeightFromDiskReqOutput(success=False, message=f"refused: {why}")
            return JSONResponse(out.model_dump(), status_code=403)
        paused = engine.load()["num_reqs"] if engine.paused else 0
        try:
            loaded = await engine.update_weights(body.model_path, version, body.abort_all_requests)
        except EngineError as exc:  # a bad checkpoint: the live model is left as it was
            out = UpdateWeightFromDiskReqOutput(success=False, message=f"failed to load weights: {exc}")
            return JSONResponse(out.model_dump(), status_code=400)
        out = UpdateWeightFromDiskReqOutput(success=True, num_paused_requests=paused,
                                            message=f"loaded {body.model_path} as version {loaded}")
        return JSONResponse(out.model_dump())

    _adapter_routes(app, engine, admin, signer)

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=admin)
    async def flush_cache() -> PlainTextResponse:
        # As SGLang: not performed while requests run or wait; empties the prefix cache.
        busy = engine.load()["num_reqs"]
        if busy:
            return PlainTextResponse(f"Cache not flushed: {busy} request(s) running or waiting.\n", status_code=400)
        await engine.run_op(engine.prefix.clear)
        return PlainTextResponse("Cache flushed.\n")

    async def _optional(request: Request, model: type[BaseModel]) -> Any:
        return model() if not (await request.body()).strip() else await _parse(request, model)

    @app.post("/pause_generation", dependencies=admin)
    async def pause_generation(request: Request) -> dict[str, Any]:
        body: PauseGenerationReqInput = await _optional(request, PauseGenerationReqInput)
        aborted = engine.set_paused(True, body.mode)
        return {"message": "Generation paused successfully.", "status": "ok", "num_aborted": aborted}

    @app.post("/continue_generation", dependencies=admin)
    async def continue_generation(request: Request) -> dict[str, Any]:
        await _optional(request, ContinueGenerationReqInput)
        engine.set_paused(False)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request", dependencies=admin)
    async def abort_request(request: Request) -> dict[str, Any]:
        body: AbortReqInput = await _parse(request, AbortReqInput)
        if not body.rid and not body.abort_all:
            raise EngineError("give a rid or abort_all=true")
        return {"success": True, "num_aborted": engine.abort(body.rid, body.abort_all)}


def _adapter_routes(app: FastAPI, engine: Engine, admin: list[Any], signer: Signer | None) -> None:
    """SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter``: 200 with ``LoRAUpdateOutput``, 400 on failure.
    With ``signer`` an adapter loads only as ``{agent}-v{version}`` of a version the agent's trainer signed (403)."""

    def answer(error: str | None = None, status: int = 400) -> JSONResponse:
        loaded = {n: a.path for n, a in engine.adapters.loaded.items()}
        out = LoRAUpdateOutput(success=error is None, error_message=error, loaded_adapters=loaded)
        return JSONResponse(out.model_dump(), status_code=200 if error is None else status)

    @app.post("/load_lora_adapter", dependencies=admin)
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body: LoadLoRAAdapterReqInput = await _parse(request, LoadLoRAAdapterReqInput)
        if signer is not None and (why := await asyncio.to_thread(
                adapter_refusal, signer, body, WeightsProof.from_headers(request.headers))):
            return answer(f"refused: {why}", 403)
        try:
            await engine.adapters.load(body.lora_name, body.lora_path)
        except EngineError as exc:
            return answer(f"failed to load adapter {body.lora_name!r}: {exc}")
        return answer()

    @app.post("/unload_lora_adapter", dependencies=admin)
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body: UnloadLoRAAdapterReqInput = await _parse(request, UnloadLoRAAdapterReqInput)
        try:
            await engine.adapters.unload(body.lora_name, engine.names_adapter)
        except EngineError as exc:
            return answer(str(exc))
        return answer()


def adapter_refusal(signer: Signer, body: LoadLoRAAdapterReqInput, proof: WeightsProof | None) -> str | None:
    """Why an adapter load is refused: its name must be ``{agent}-v{version}`` for one of the engine's agents and
    the version one that agent's trainer signed (``weights_auth.load_refusal``); None to load it."""
    secret, agents = signer
    for agent in agents:
        tail = body.lora_name[len(f"{agent}-v"):] if body.lora_name.startswith(f"{agent}-v") else ""
        if tail.isdigit():
            return load_refusal(secret, agent, int(tail), body.lora_path, proof)
    names = " or ".join(f"{a}-v<version>" for a in agents)
    return (f"adapter name {body.lora_name!r} is not {names}: this engine serves "
            f"agent{'s' if len(agents) > 1 else ''} {', '.join(repr(a) for a in agents)}")
