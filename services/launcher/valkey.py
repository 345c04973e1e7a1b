"""The embedded Valkey of ``tandem up``: started with the run's data directory, supervised and restarted in place.

``start_embedded`` starts it (its AOF under ``runs/<run>/redis``, password-protected) unless the config names
an external Redis; ``RedisProcess`` puts it under the launcher's supervision (services/launcher/processes.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from services.common.embedded_redis import EmbeddedRedis
from services.contracts.config import TandemConfig
from services.launcher.processes import Supervised

log = logging.getLogger("tandem.launcher")


def start_embedded(cfg: TandemConfig, run_dir: Path, resume: bool, console: Console) -> EmbeddedRedis | None:
    """The run's embedded Valkey, started (None when the config names an external Redis)."""
    if cfg.redis_url:
        return None
    redis = EmbeddedRedis(data_dir=run_dir / "redis", appendfsync=cfg.run.redis_appendfsync,
                          maxmemory_mb=cfg.run.redis_maxmemory_mb).start(timeout=120)
    console.print(f"embedded Redis on 127.0.0.1:{redis.port} (password-protected; data in {run_dir / 'redis'})"
                  + (", resumed from its AOF" if resume else ""))
    return redis


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


@dataclass
class RedisProcess(Supervised):
    """The embedded Valkey under supervision: restarted on the same port, password and AOF, by a thread of its
    own that lives as long as the launcher (replaying a large AOF takes a while; the launcher's loop goes on
    supervising the services meanwhile). One long-lived thread, because the parent-death signal that ends
    Valkey with the launcher fires when the *thread* that started it exits."""

    server: EmbeddedRedis | None = None
    idle: threading.Event = field(default_factory=lambda: _set(threading.Event()))  # cleared while restarting
    requests: queue.Queue[None] = field(default_factory=queue.Queue)
    worker: threading.Thread | None = None

    def failed(self) -> bool:
        if not self.idle.is_set():
            return False  # a restart under way: it ends answering, or dead (then this is failed again)
        return self.server is not None and not self.server.alive()

    def exit_code(self) -> int | None:
        return self.server.proc.poll() if self.server and self.server.proc else None

    def respawn(self) -> None:
        if self.worker is None or not self.worker.is_alive():
            self.worker = threading.Thread(target=self._serve, name="valkey-restarts", daemon=True)
            self.worker.start()
        self.idle.clear()
        self.requests.put(None)

    def _serve(self) -> None:
        assert self.server is not None
        while True:
            self.requests.get()
            try:
                self.server.restart()
            except Exception as exc:  # it did not come up: the next supervision counts another death
                log.warning("the embedded Redis did not come back: %s", exc)
            finally:
                self.idle.set()

    def join(self, timeout: float = 60.0) -> None:
        """Wait for a restart under way to end."""
        self.idle.wait(timeout)
