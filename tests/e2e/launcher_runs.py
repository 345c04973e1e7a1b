"""Running ``tandem up`` from the launcher tests: a long tic-tac-toe run's config, its start, its children as
``/proc`` shows them, its training steps through ``/v1/status``, and its stop."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from services.common.embedded_redis import free_port
from tests.helpers import launch_up


def children_of(pid: int) -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def run_config(tmp_path: Path, model: Path, name: str, agents: tuple[str, ...] = ("A", "B"),
            **run: object) -> tuple[Path, int]:
    """A long tic-tac-toe run: ``agents`` play X and O (one agent plays X against the scripted random player)."""
    port = free_port()
    roles = {"X": agents[0], "O": agents[1] if len(agents) > 1 else "scripted:random"}
    cfg = {"run": {"name": name, "total_steps": 50, "checkpoint_root": str(tmp_path / "ckpt"),
                   "output_dir": str(tmp_path / "runs"), **run},
           "api": {"port": port},
           "environment": {"name": "tictactoe", "group_size": 2, "roles": roles,
                           "eval": {"episodes": 4}},
           "agents": {a: {"model_path": str(model), "groups_per_batch": 2, "max_no_signal_steps": 0}
                      for a in agents}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, port


def start_run(tmp_path: Path, model: Path, name: str, *flags: str, log: Path | None = None,
               **run: object) -> tuple[subprocess.Popen, dict[int, str]]:
    """Start ``tandem up`` on a long run of agent A alone (what the launcher does is per service, so one agent's
    services show it at half the processes); return it and its children once the control API answers.
    With ``log`` the launcher's output goes to that file (read it with ``log.read_text()``)."""
    path, port = run_config(tmp_path, model, name, agents=("A",), **run)
    out = log.open("w") if log else subprocess.PIPE
    proc = launch_up(path, *flags, stdout=out, text=True)
    proc.api = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    deadline = time.time() + 240
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text() if log else proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(f"{proc.api}/health", timeout=1).status_code == 200:  # type: ignore[attr-defined]
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    while time.time() < deadline and trained_services(children_of(proc.pid)) < 2:  # a new run's buffer and trainer
        assert proc.poll() is None, log.read_text() if log else ""     # start after its first turn
        time.sleep(0.3)
    return proc, children_of(proc.pid)


def trained_services(children: dict[int, str]) -> int:
    return sum("services.buffer --config" in cmd or "services.trainer --config" in cmd for cmd in children.values())


def logged_run(tmp_path: Path, model: Path, name: str,
                **run: object) -> tuple[subprocess.Popen, dict[int, str], Path]:
    """``start_run`` with the launcher's output in ``tmp_path/launcher.log``, also returned."""
    log = tmp_path / "launcher.log"
    return (*start_run(tmp_path, model, name, log=log, **run), log)


def steps_done(proc: subprocess.Popen) -> int:
    """Training steps done so far, both agents together (0 while the API does not answer)."""
    try:
        status = httpx.get(f"{proc.api}/v1/status", timeout=2).json()  # type: ignore[attr-defined]
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(int(a["step"]) for a in status["agents"].values())


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> float:
    """Seconds until ``cond()`` holds; fails naming ``what`` (with the launcher's output) otherwise."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) waiting for {what}:\n" + \
            log.read_text()[-3000:]
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout:.0f}s:\n" + log.read_text()[-3000:])


def stop_run(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()


def all_gone(children: dict[int, str]) -> None:
    for pid, cmd in children.items():
        alive = Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
        assert not alive, f"child {pid} ({cmd}) outlived the launcher"


def victim(children: dict[int, str], *parts: str) -> int:
    return next(pid for pid, cmd in children.items() if all(p in cmd for p in parts))


