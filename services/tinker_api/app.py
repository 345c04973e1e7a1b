"""The HTTP face of the Tinker API service (docs/architecture.md §12): the routes the official SDK (0.38) calls.

Every training or sampling call answers at once with a future (``request_id``); the SDK
long-polls ``/api/v1/retrieve_future`` for its result. A bad request is answered 400 with
``{"error", "detail", "category": "user"}``; a failed future carries the same
``{"error", "category"}``. With ``api_keys`` set, every route but the health checks needs one of
them in ``X-API-Key`` (the SDK sends its ``TINKER_API_KEY`` there), or, with ``jwt_auth``, a JWT
this server minted for one (``identity.py``). The routes themselves are in ``routes.py``, one router
per group.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.tinker_api import identity, routes
from services.tinker_api.config import ServeConfig
from services.tinker_api.lifetimes import Reaper
from services.tinker_api.losses import UserError
from services.tinker_api.rest_routes import FILES_PREFIX, rest_routes
from services.tinker_api.routes import user_error
from services.tinker_api.service import TinkerService
from services.tinker_api.session_rest import session_rest_routes
from services.tinker_api.store import Store

OPEN_PATHS = ("/api/v1/healthz", "/health")
SIGNED_PREFIX = FILES_PREFIX  # a signed file URL carries its own credential


def install_guards(app: FastAPI, api_keys: list[str], secret: bytes | None) -> None:
    """The credential check (an API key, or with ``secret`` a JWT minted here), and the error shapes:
    ``user`` (400/401) for bad input, ``server`` (500) else."""

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        open_path = request.url.path in OPEN_PATHS or request.url.path.startswith(SIGNED_PREFIX)
        given = request.headers.get("x-api-key") or ""
        if api_keys and not open_path and not any(hmac.compare_digest(given.encode(), k.encode()) for k in api_keys):
            if secret is None or not identity.is_jwt(given):
                return user_error("X-API-Key: missing or not one of this server's API keys", 401)
            if identity.verify(secret, given) is None:
                response = user_error("X-API-Key: a JWT this server did not sign, or expired", 401)
                response.headers["WWW-Authenticate"] = 'Bearer error="invalid_token"'
                return response
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


def auth_routes(secret: bytes, keyed: bool) -> APIRouter:
    """``/api/v1/auth/token``: the SDK's exchange of its credential (checked by the guard) for a JWT."""
    r = APIRouter()

    @r.post("/api/v1/auth/token")
    async def auth_token(request: Request) -> dict[str, str]:
        given = request.headers.get("x-api-key") or ""
        claims = identity.verify(secret, given) if identity.is_jwt(given) else None
        sub = claims.sub if claims is not None else identity.principal(given, keyed)
        return {"jwt": identity.mint(secret, sub)}

    return r


def create_app(cfg: ServeConfig, redis_url: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(redis_url)
        await store.ping()
        svc = TinkerService(store, cfg.data_dir, cfg.sampler_cache, cfg.resolved_device(), cfg.models)
        app.state.svc = svc
        await svc.recover()
        reaper = asyncio.create_task(Reaper(svc, cfg.session_idle_s, cfg.sampler_idle_s, cfg.reap_every_s).run())
        try:
            yield
        finally:
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)
            await svc.close()
            await store.close()

    app = FastAPI(title="Tandem Tinker API", lifespan=lifespan)

    def svc() -> TinkerService:
        return app.state.svc

    secret = identity.load_secret(cfg.data_dir) if cfg.jwt_auth else None
    install_guards(app, list(cfg.api_keys), secret)
    if secret is not None:
        app.include_router(auth_routes(secret, bool(cfg.api_keys)))
    app.include_router(routes.service_routes(cfg, svc))
    app.include_router(routes.session_routes(svc))
    app.include_router(routes.model_routes(svc))
    app.include_router(routes.training_routes(svc))
    app.include_router(routes.sampling_routes(svc))
    app.include_router(rest_routes(svc))
    app.include_router(session_rest_routes(svc))
    app.include_router(routes.unserved_routes(svc))  # last: it matches every path
    return app
