"""Child processes of the local launcher: start, prefix their logs, watch, stop.

Every child gets the parent-death signal (Linux), so none outlives the
launcher; each child's output goes to ``runs/<run>/logs/<name>.log`` and,
prefixed with its name, to the console.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen[bytes]
    pump: threading.Thread
    critical: bool = True


@dataclass
class ProcessGroup:
    log_dir: Path
    env: dict[str, str]
    echo: Callable[[str, str], None]
    children: list[Child] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def start(self, name: str, cmd: list[str], critical: bool = True) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        pump = threading.Thread(target=self._pump, args=(name, proc), daemon=True)
        pump.start()
        child = Child(name, cmd, proc, pump, critical)
        self.children.append(child)
        return child

    def _pump(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with open(self.log_dir / f"{name}.log", "ab") as f:
            for line in proc.stdout:
                f.write(line)
                f.flush()
                text = line.decode(errors="replace").rstrip()
                if text:
                    self.echo(name, text)

    def dead(self) -> Child | None:
        """The first critical child that failed (non-zero exit), if any.

        Services exit 0 only when told to stop (the run's end), so a zero exit
        is not a death."""
        for c in self.children:
            if c.critical and c.proc.poll() not in (None, 0):
                return c
        return None

    def exited(self, name: str) -> int | None:
        for c in self.children:
            if c.name == name:
                return c.proc.poll()
        return None

    def wait_http(self, url: str, child: Child, timeout: float = 120.0) -> None:
        """Wait until GET url answers 200 (or the child dies)."""
        waiter = threading.Event()
        deadline = timeout / 0.25
        for _ in range(int(deadline)):
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} while starting")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            waiter.wait(0.25)
        raise RuntimeError(f"{child.name} did not answer {url} within {timeout:.0f}s")

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
