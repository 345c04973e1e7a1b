"""A tiny HTTP health endpoint for the long-running services (no web framework).

``GET /health`` answers 200 ``{"service": name, "ok": true}`` while the
service's loops run and 503 ``{"ok": false, "reason": ...}`` once it is
stopping or a loop has ended. Container HEALTHCHECKs and Kubernetes probes
call it (``python -m services.common.health`` is the HEALTHCHECK command).
Served with ``asyncio.start_server``: one request per connection, then close.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

HEALTH_PORT_ENV = "TANDEM_HEALTH_PORT"
MAX_HEAD = 8192
READ_TIMEOUT_S = 5.0

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


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


class HealthServer:
    """Serves ``GET /health``; ``status()`` returns ``(ok, reason)`` at each request."""

    def __init__(self, service: str, status: Callable[[], tuple[bool, str]], host: str = "0.0.0.0",
                 port: int = 0) -> None:
        self.service, self.status, self.host, self.port = service, status, host, port
        self.started = time.time()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def _answer(self, method: str, path: str) -> tuple[int, dict]:
        if path.split("?", 1)[0] != "/health":
            return 404, {"error": f"no such path {path!r}; the health endpoint is GET /health"}
        if method not in ("GET", "HEAD"):
            return 405, {"error": f"{method} is not allowed on /health; use GET"}
        ok, reason = self.status()
        body = {"service": self.service, "ok": ok, "uptime_s": round(time.time() - self.started, 1)}
        if not ok:
            body["reason"] = reason
        return (200 if ok else 503), body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method = "GET"
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                code, body = 400, {"error": "malformed request line; expected 'GET /health HTTP/1.1'"}
            else:
                method = parts[0]
                code, body = self._answer(method, parts[1])
        except asyncio.LimitOverrunError:
            code, body = 400, {"error": f"request head longer than {MAX_HEAD} bytes"}
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            writer.close()
            return
        payload = json.dumps(body).encode()
        extra = b"Allow: GET, HEAD\r\n" if code == 405 else b""
        writer.write(f"HTTP/1.1 {code} {_REASONS[code]}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n".encode() + extra + b"\r\n"
                     + (b"" if method == "HEAD" else payload))
        try:
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


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
