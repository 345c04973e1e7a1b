"""The embedded engine's HTTP server: SGLang's native API (DESIGN §5) over ``generator.Engine``.

``create_app(model_path, weight_version, max_batch, engine_id)`` loads the model
and returns a FastAPI app serving ``/health``, ``/health_generate``,
``/get_model_info`` (+ ``/model_info``), ``/get_server_info`` (+ ``/server_info``),
``/get_load``, ``/generate``, ``/update_weights_from_disk``, ``/get_weight_version``,
``/flush_cache``, ``/pause_generation``, ``/continue_generation`` and
``/abort_request``. The ``model_info``/``server_info`` aliases and ``/get_load``
are what the SGLang router (sglang-router 0.3.2) reads when it registers and
load-monitors a worker (see ``services/common/sglang_router.py``).

Bad input is answered 400 with SGLang's error object (``error_body``), never
a 500. The router adds a few SGLang fields of its own to every ``/generate``
body (``model``, ``log_metrics``, ``return_text_in_logprobs``...); those are
accepted when they ask for nothing this engine lacks, any other unknown
field is rejected.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from services.contracts.sglang_api import (
    AbortReqInput,
    ContinueGenerationReqInput,
    GenerateReqInput,
    GenerateReqOutput,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    error_body,
)
from services.inference.generator import Engine, EngineError, GenRequest

VERSION = "0.5.0-tandem-embedded"

# Fields SGLang's router adds to /generate bodies: name -> values we can honour (None: any value).
_ROUTER_FIELDS: dict[str, tuple[Any, ...] | None] = {
    "model": None, "log_metrics": None, "no_logs": None, "return_text_in_logprobs": None,
    "return_hidden_states": (False,), "background": (False,), "return_bytes": (False,),
    "return_entropy": (False,), "logprob_start_len": None, "top_logprobs_num": (None, 0),
    "custom_labels": None,
}


def _bad(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message, code), status_code=code)


def _validation_message(exc: ValidationError | RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """Parse a JSON body into ``model``; raise EngineError with the reason otherwise."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise EngineError("body must be a JSON object")
    if model is GenerateReqInput:
        extras = {name: body.pop(name) for name in _ROUTER_FIELDS if name in body}
        for name, value in extras.items():
            allowed = _ROUTER_FIELDS[name]
            if allowed is not None and value not in allowed:
                raise EngineError(f"{name}={value!r} is not supported by the embedded engine")
        request.state.text_in_logprobs = bool(extras.get("return_text_in_logprobs", False))
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise EngineError(_validation_message(exc)) from None


def create_app(model_path: str | Path, weight_version: int = 0, max_batch: int = 64,
               engine_id: str | None = None) -> FastAPI:
    engine = Engine(model_path, weight_version=weight_version, max_batch=max_batch)
    path = str(Path(model_path).resolve())

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        yield
        engine.stop()

    app = FastAPI(title="Tandem embedded engine (SGLang API)", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _bad(_validation_message(exc))

    @app.exception_handler(EngineError)
    async def _on_engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return _bad(str(exc))

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
                "disaggregation_mode": "null", "device": "cpu", "dtype": "float32",
                "internal_states": [{"paused": engine.paused, **engine.load(), **engine.stats}]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if engine.load()["num_reqs"] and time.monotonic() - engine.last_step_at < 5.0:
            return Response(status_code=200)  # as SGLang: busy and making progress is healthy
        req = GenRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=[engine.pad_id], temperature=0.0,
                         max_new_tokens=1)
        try:
            await asyncio.wait_for(engine.generate(req), timeout=30.0)
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

    def reply(req: GenRequest, req_in: GenerateReqInput, prompt_len: int, start: float,
              with_text: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid, "finish_reason": req.finish, "prompt_tokens": prompt_len,
            "completion_tokens": len(req.output_ids), "cached_tokens": 0,
            "weight_version": str(req.weight_version), "weight_versions": req.weight_version_spans(),
            "e2e_latency": time.perf_counter() - start,
        }
        if engine_id is not None:
            meta["engine"] = engine_id
        if req_in.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, engine.tokenizer.decode([t]) if with_text else None]
                for lp, t in zip(req.logprobs, req.output_ids, strict=True)]
        text = engine.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        matched = (req.finish or {}).get("matched")
        if isinstance(matched, str) and matched in text:  # as SGLang (no_stop_trim false): text ends before it
            text = text[:text.index(matched)]
        out = GenerateReqOutput.model_validate({"text": text, "output_ids": req.output_ids, "meta_info": meta})
        body = out.model_dump(mode="json", exclude_none=True)
        body["meta_info"]["finish_reason"] = req.finish  # SGLang's to_json(): every key, None included
        return body

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        req_in: GenerateReqInput = await _parse(request, GenerateReqInput)
        sp = req_in.sampling_params
        ids = req_in.input_ids
        if ids is None:
            ids = list(engine.tokenizer(req_in.text)["input_ids"])
            if not ids:
                raise EngineError("text tokenizes to no tokens")
        stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
        rid = req_in.rid or uuid.uuid4().hex
        reqs = [GenRequest(rid=rid if sp.n == 1 else f"{rid}-{i}", input_ids=list(ids), temperature=sp.temperature,
                           top_p=sp.top_p, top_k=sp.top_k, max_new_tokens=sp.max_new_tokens,
                           stop_token_ids=frozenset(sp.stop_token_ids or ()), stop_strings=stop,
                           seed=None if sp.sampling_seed is None else sp.sampling_seed + i, ignore_eos=sp.ignore_eos)
                for i in range(sp.n)]
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(r) for r in reqs))
        with_text = request.state.text_in_logprobs
        outs = [reply(r, req_in, len(ids), start, with_text) for r in reqs]
        return JSONResponse(outs[0] if sp.n == 1 else outs)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body: UpdateWeightFromDiskReqInput = await _parse(request, UpdateWeightFromDiskReqInput)
        version: int | None = None
        if body.weight_version is not None:
            try:
                version = int(body.weight_version)
            except ValueError:
                raise EngineError(f"weight_version must be an integer, got {body.weight_version!r}") from None
        paused = engine.load()["num_reqs"] if engine.paused else 0
        try:
            loaded = await engine.update_weights(body.model_path, version, body.abort_all_requests)
        except EngineError as exc:  # a bad checkpoint: the live model is left as it was
            out = UpdateWeightFromDiskReqOutput(success=False, message=f"failed to load weights: {exc}")
            return JSONResponse(out.model_dump(), status_code=400)
        out = UpdateWeightFromDiskReqOutput(success=True, num_paused_requests=paused,
                                            message=f"loaded {body.model_path} as version {loaded}")
        return JSONResponse(out.model_dump())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        # As SGLang: not performed while requests run or wait. Nothing else to flush: a finished
        # request's KV rows leave the batch with it (no prefix cache is kept across requests).
        busy = engine.load()["num_reqs"]
        if busy:
            return PlainTextResponse(f"Cache not flushed: {busy} request(s) running or waiting.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    async def _optional(request: Request, model: type[BaseModel]) -> Any:
        return model() if not (await request.body()).strip() else await _parse(request, model)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        body: PauseGenerationReqInput = await _optional(request, PauseGenerationReqInput)
        aborted = engine.set_paused(True, body.mode)
        return {"message": "Generation paused successfully.", "status": "ok", "num_aborted": aborted}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, Any]:
        await _optional(request, ContinueGenerationReqInput)
        engine.set_paused(False)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body: AbortReqInput = await _parse(request, AbortReqInput)
        if not body.rid and not body.abort_all:
            raise EngineError("give a rid or abort_all=true")
        return {"success": True, "num_aborted": engine.abort(body.rid, body.abort_all)}

    return app
