"""The long-running services' health and metrics endpoint, on FastAPI/uvicorn.

``GET /health`` answers 200 ``{"service": name, "ok": true}`` while the
service's loops run and 503 ``{"ok": false, "reason": ...}`` once it is
stopping or a loop has ended. Container HEALTHCHECKs and Kubernetes probes
call it (``python -m services.common.health`` is the HEALTHCHECK command).
``GET /metrics`` serves the process's own Prometheus registry (bus counters,
handler latency, process metrics; services/common/metrics.py). Every answer
closes its connection: probes do not keep connections open.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the web stack is imported where it serves, so the HEALTHCHECK probe starts fast
    import uvicorn
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry

HEALTH_PORT_ENV = "TANDEM_HEALTH_PORT"
START_TIMEOUT_S = 10.0
PATHS = ("/health", "/metrics")


def health_port_from_env(environ: dict[str, str] | None = None) -> int:
    """``TANDEM_HEALTH_PORT`` as a port number (0 = off); a bad value names the variable."""
    raw = (os.environ if environ is None else environ).get(HEALTH_PORT_ENV, "0").strip() or "0"
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{HEALTH_PORT_ENV}={raw!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{HEALTH_PORT_ENV}={port} is outside 0..65535")
    return port


def health_app(service: str, status: Callable[[], tuple[bool, str]], started: float,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """``GET /health`` and ``GET /metrics`` (``registry``: default, the process's); anything else
    gets a JSON error naming the endpoints."""
    from fastapi import FastAPI, Header, Request, Response
    from fastapi.responses import JSONResponse
    from prometheus_client import REGISTRY
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from services.common.metrics import exposition

    app = FastAPI(title=f"{service} health", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def _error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:
            return JSONResponse({"error": f"{request.method} is not allowed on {request.url.path}; use GET"},
                                405, headers={"Allow": "GET, HEAD"})
        return JSONResponse({"error": f"no such path {request.url.path!r}; the endpoints are GET "
                                      f"{' and GET '.join(PATHS)}"}, exc.status_code)

    @app.middleware("http")
    async def _close(request: Request, call_next: Callable) -> Response:
        response = await call_next(request)
        response.headers["Connection"] = "close"
        return response

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        ok, reason = status()
        body: dict = {"service": service, "ok": ok, "uptime_s": round(time.time() - started, 1)}
        if not ok:
            body["reason"] = reason
        return JSONResponse(body, 200 if ok else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(accept: str | None = Header(default=None)) -> Response:
        payload, content_type = exposition(registry or REGISTRY, accept)
        return Response(payload, media_type=content_type)

    return app


def probe_server(config: uvicorn.Config) -> uvicorn.Server:
    """A uvicorn server without its signal handlers: the service owns SIGTERM/SIGINT and closes it."""
    import uvicorn

    class ProbeServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return ProbeServer(config)


class HealthServer:
    """Serves ``GET /health`` and ``GET /metrics``; ``status()`` returns ``(ok, reason)`` at each request."""

    def __init__(self, service: str, status: Callable[[], tuple[bool, str]], host: str = "0.0.0.0",
                 port: int = 0, registry: CollectorRegistry | None = None) -> None:
        self.service, self.status, self.host, self.port = service, status, host, port
        self.registry = registry
        self.started = time.time()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind (an ``OSError`` here names a taken port), then serve; returns the bound port."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(health_app(self.service, self.status, self.started, self.registry),
                                log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=2)
        self._server = probe_server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done() or time.monotonic() > deadline:
                await self.close()
                raise OSError(f"the health endpoint on port {self.port} did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def close(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception, SystemExit):
                await self._task
        self._server = self._task = None


def probe(url: str, timeout: float = 3.0) -> tuple[int, str]:
    """One blocking ``GET url``: (status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (a local URL we build)
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def main(argv: list[str] | None = None) -> int:
    """HEALTHCHECK: ``python -m services.common.health [URL]`` exits 0 on 200, 1 otherwise.

    Without a URL it asks ``http://127.0.0.1:$TANDEM_HEALTH_PORT/health``."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        url = args[0]
    else:
        port = health_port_from_env()
        if port == 0:
            print(f"{HEALTH_PORT_ENV} is not set: this service serves no health endpoint", file=sys.stderr)
            return 1
        url = f"http://127.0.0.1:{port}/health"
    status, body = probe(url)
    print(f"{url}: {status or 'no answer'} {body}"[:500])
    return 0 if status == 200 else 1


if __name__ == "__main__":
    raise SystemExit(main())
