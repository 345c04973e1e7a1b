"""One run, one stack: the launcher of a run holds an exclusive lock on ``runs/.<run>.lock`` while it lives.

The lock is the kernel's (``flock``): it goes with the launcher's last open file, so a launcher that is
killed (SIGKILL, a crash, a lost machine's reboot) cannot leave it stuck, and no liveness guess is needed.
The file beside the run's directory (not in it: ``--fresh`` deletes the directory) says who holds it: the
launcher's pid, its start time and its config, so a second ``tandem up`` or ``--resume`` of a live run is
refused naming the live one (``RunIsLive``), before it touches the run's Redis AOF, checkpoints or report.
Children do not inherit the descriptor (Python opens it non-inheritable), so a child that outlives the
launcher does not keep the lock. The lock is per machine: runs that share an external Redis across
machines need their own guard (each run's keys are namespaced by its name).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from services.contracts.config import TandemConfig

RUN_IS_LIVE = 5  # the exit code of a refused `tandem up` (the run is live under another launcher)
_held: dict[Path, int] = {}  # lock file -> descriptor, per process (flock conflicts between descriptors)


class RunIsLive(RuntimeError):
    """Another launcher holds this run."""


def lock_path(cfg: TandemConfig) -> Path:
    run_dir = cfg.run_dir()
    return run_dir.parent / f".{run_dir.name}.lock"


def _holder(fd: int) -> dict[str, Any]:
    try:
        return dict(json.loads(os.pread(fd, 4096, 0).decode() or "{}"))
    except (OSError, ValueError):
        return {}


def check_live(cfg: TandemConfig) -> None:
    """``RunIsLive`` when another launcher holds the run; creates nothing (a refused start touches nothing)."""
    path = lock_path(cfg)
    if path in _held or not path.exists():
        return
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        _lock(cfg, path, fd)
    finally:
        os.close(fd)  # closing gives a lock taken here back


def acquire(cfg: TandemConfig, config_path: str) -> Path:
    """Hold the run's lock for this process's life (again: a no-op); ``RunIsLive`` naming the holder."""
    path = lock_path(cfg)
    if path in _held:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _lock(cfg, path, fd)
    except RunIsLive:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "started_at": time.time(), "config": config_path,
                              "run": cfg.run.name}).encode(), 0)
    _held[path] = fd
    return path


def _lock(cfg: TandemConfig, path: Path, fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _holder(fd)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["started_at"])) if "started_at" in who else "?"
        pid = who.get("pid", "?")
        raise RunIsLive(f"run {cfg.run.name!r} is live: `tandem up {who.get('config', '?')}` (pid {pid}, since "
                        f"{since}) holds {path}. Stop it first (Ctrl-C, or kill {pid}); "
                        "a second stack on the same run would share its Redis AOF and checkpoints") from None


def release(cfg: TandemConfig) -> None:
    """Give the lock back (the process's exit does it too)."""
    fd = _held.pop(lock_path(cfg), None)
    if fd is not None:
        os.close(fd)
