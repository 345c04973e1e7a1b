"""Child processes of the local launcher: start, prefix their logs, supervise, restart, stop.

Every child gets the parent-death signal (Linux), so none outlives the launcher, even one killed
by SIGKILL; each child's output goes to ``runs/<run>/logs/<name>.log`` and, line by line, to the
launcher's ``echo`` (services/launcher/live_view.py: every line with ``--verbose``, else warnings and errors).
``ProcessGroup.supervise`` restarts a child that exited unexpectedly (a
non-zero exit code or a signal: services exit 0 only when told to stop; 2, a bad config, and 3,
a run that failed for good, are never restarted) in place, with
exponential backoff, as long as the ``RestartBudget`` allows: at most ``max_restarts`` restarts
of one service within a sliding window of ``window_s`` seconds. Past it, ``ServiceFailed`` names
the service and its exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.lifetime import die_with_parent

# exit codes a restart cannot fix: the run stops at once, naming the reason
PERMANENT_EXITS = {2: "a bad config", 3: "the run failed"}
LOST_EPISODES = 4  # ``tandem up``'s exit code for a run that finished but lost episodes (summary: episodes_failed)


class ServiceFailed(RuntimeError):
    """A service died more often than the restart budget allows (the message names it and why)."""


@dataclass
class RestartBudget:
    """At most ``max_restarts`` restarts per service within any ``window_s`` seconds; backoff doubles
    from ``first_delay_s`` with each restart still inside the window, up to ``max_delay_s``."""

    max_restarts: int
    window_s: float
    first_delay_s: float = 0.5
    max_delay_s: float = 15.0

    def recent(self, history: deque[float], now: float) -> int:
        while history and history[0] <= now - self.window_s:
            history.popleft()
        return len(history)

    def allows(self, history: deque[float], now: float) -> bool:
        return self.recent(history, now) < self.max_restarts

    def delay(self, history: deque[float], now: float) -> float:
        return min(self.first_delay_s * 2 ** self.recent(history, now), self.max_delay_s)


@dataclass
class Supervised(ABC):
    """Something the launcher restarts when it dies: a service process, or the embedded Redis."""

    name: str
    critical: bool = True
    restarts: int = 0
    history: deque[float] = field(default_factory=deque)  # times of the restarts still in the window
    due: float | None = None  # when the scheduled restart happens

    @abstractmethod
    def failed(self) -> bool: ...

    @abstractmethod
    def exit_code(self) -> int | None: ...

    @abstractmethod
    def respawn(self) -> None: ...


@dataclass
class Child(Supervised):
    cmd: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] = None  # type: ignore[assignment]
    pump: threading.Thread = None  # type: ignore[assignment]
    spawn: Callable[[str, list[str]], tuple[subprocess.Popen[bytes], threading.Thread]] | None = None

    def failed(self) -> bool:
        """Exited on its own with a non-zero code or by a signal (services exit 0 only when told to stop)."""
        return self.proc.poll() not in (None, 0)

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def respawn(self) -> None:
        assert self.spawn is not None
        self.pump.join(timeout=2)
        self.proc, self.pump = self.spawn(self.name, self.cmd)


@dataclass
class ProcessGroup:
    log_dir: Path
    env: dict[str, str]
    echo: Callable[[str, str], None]
    budget: RestartBudget = field(default_factory=lambda: RestartBudget(0, 60.0))
    on_restart: Callable[[str, int], None] = lambda name, count: None
    children: list[Child] = field(default_factory=list)
    others: list[Supervised] = field(default_factory=list)  # supervised first (the embedded Redis)
    stopping: threading.Event = field(default_factory=threading.Event)
    winding_down: threading.Event = field(default_factory=threading.Event)  # the run is over: see supervise
    let_go: set[str] = field(default_factory=set)  # children that died while winding down (not restarted)

    def _spawn(self, name: str, cmd: list[str]) -> tuple[subprocess.Popen[bytes], threading.Thread]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                                stdin=subprocess.DEVNULL, preexec_fn=die_with_parent())
        pump = threading.Thread(target=self._pump, args=(name, proc), daemon=True)
        pump.start()
        return proc, pump

    def start(self, name: str, cmd: list[str], critical: bool = True) -> Child:
        proc, pump = self._spawn(name, cmd)
        child = Child(name, critical=critical, cmd=cmd, proc=proc, pump=pump, spawn=self._spawn)
        self.children.append(child)
        return child

    def _pump(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        """Drain the child's output into its log file and the console. A log that cannot be written (a full
        disk: ENOSPC) never stops the draining (a child blocked on a full pipe would hang): the line is still
        echoed, the failure is said once per outage, and writing is tried again with the next line."""
        assert proc.stdout is not None
        path = self.log_dir / f"{name}.log"
        f, failing = None, False
        try:
            for line in proc.stdout:
                try:
                    f = f or open(path, "ab")  # noqa: SIM115 (kept open across lines; closed below)
                    f.write(line)
                    f.flush()
                    failing = False
                except OSError as exc:
                    if not failing:
                        self._say(name, f"cannot write its log ({exc.strerror}: disk full at {path}?); "
                                        "its output is shown here only until space returns")
                    failing = True
                    if f is not None:
                        with contextlib.suppress(OSError):
                            f.close()
                    f = None
                text = line.decode(errors="replace").rstrip()
                if text:
                    self._say(name, text)
        finally:
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def _say(self, name: str, text: str) -> None:
        with contextlib.suppress(OSError):  # the launcher's own output on a full disk: the draining goes on
            self.echo(name, text)

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart the children that died and whose backoff is over; return what happened, one line each.

        Raises ``ServiceFailed`` when a critical child died with its restart budget spent. While the run
        winds down (``winding_down``: its work is done, the coordinator is stopping the services) only the
        coordinator and the ``others`` (the embedded Redis) are restarted."""
        now = time.monotonic() if now is None else now
        notes = []
        for c in [*self.others, *self.children]:
            if not c.critical or self.stopping.is_set() or not c.failed():
                continue
            if self.winding_down.is_set() and c in self.children and c.name != "coordinator":
                if c.name not in self.let_go:  # noted once
                    notes.append(f"{c.name} exited (code {c.exit_code()}) while the run winds down: not restarted")
                    self.let_go.add(c.name)
                continue
            if c.due is None:
                code = c.exit_code()
                if code in PERMANENT_EXITS:
                    raise ServiceFailed(f"{c.name} exited with code {code} ({PERMANENT_EXITS[code]}); stopping the "
                                        f"run (see {self.log_dir / (c.name + '.log')})")
                if not self.budget.allows(c.history, now):
                    raise ServiceFailed(f"{c.name} died (exit code {code}) after {self.budget.recent(c.history, now)}"
                                        f" restart(s) within {self.budget.window_s:.0f}s (run.max_restarts="
                                        f"{self.budget.max_restarts}); stopping the run")
                delay = self.budget.delay(c.history, now)
                c.due = now + delay
                notes.append(f"{c.name} died (exit code {code}); restarting it in {delay:.1f}s")
            if now >= c.due:
                c.respawn()
                c.history.append(now)
                c.restarts += 1
                c.due = None
                self.on_restart(c.name, c.restarts)
                notes.append(f"{c.name} restarted (restart {c.restarts})")
        return notes

    def restart_counts(self) -> dict[str, int]:
        return {c.name: c.restarts for c in [*self.others, *self.children]}

    def exited(self, name: str) -> int | None:
        for c in self.children:
            if c.name == name:
                return c.proc.poll()
        return None

    def stop_all(self, grace: float = 10.0) -> None:
        self.stopping.set()
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in reversed(self.children):
            try:
                c.proc.wait(grace)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        for c in self.children:
            c.pump.join(timeout=2)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TANDEM_HEALTH_PORT", None)  # one port per container; here every service shares the host
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    env.update(extra)
    return env
