"""A live ``tandem serve`` (the Tinker API service) on a free loopback port, for the SDK tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.common.embedded_redis import free_port

ROOT = Path(__file__).resolve().parents[1]


class TinkerServer:
    def __init__(self, redis_url: str, data_dir: Path, port: int | None = None, api_keys: list[str] | None = None,
                 settings: dict[str, object] | None = None):
        self.port = port or free_port()
        self.data_dir = data_dir
        self.config = data_dir / "serve.yaml"
        data_dir.mkdir(parents=True, exist_ok=True)
        keys = "".join(f"\n    - {k}" for k in api_keys or [])
        self.config.write_text(f"tinker_api:\n  redis_url: {redis_url}\n  data_dir: {data_dir}\n"
                               + (f"  api_keys:{keys}\n" if keys else "")
                               + "".join(f"  {k}: {v}\n" for k, v in (settings or {}).items()))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> TinkerServer:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        cmd = [sys.executable, "-m", "services.launcher.cli", "serve", str(self.config), "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tandem serve did not answer within {timeout}s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: nothing is flushed, nothing is shut down cleanly."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
