"""The local launcher: a bad config fails before anything starts; a dying child stops the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.common.embedded_redis import free_port

REPO = Path(__file__).resolve().parents[1]


def _children(pid: int) -> dict[int, str]:
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


def test_bad_config_fails_before_any_service_starts(tmp_path):
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data["agents"]["B"]["groups_per_batch"] = 0
    data["environment"]["params"] = {"board_size": 4}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    res = subprocess.run([sys.executable, "-m", "services.launcher.cli", "up", str(bad)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "agents.B.groups_per_batch" in res.stderr
    assert not (tmp_path / "runs").exists(), "something started before the config was checked"

    data["agents"]["B"]["groups_per_batch"] = 4
    bad.write_text(yaml.safe_dump(data))
    res = subprocess.run([sys.executable, "-m", "services.launcher.cli", "up", str(bad)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "environment.params" in res.stderr and "board_size" in res.stderr
    assert "agents.A.model_path" in res.stderr  # models/demo-ttt does not exist under tmp_path


def _start_run(tmp_path: Path, model: Path, name: str) -> tuple[subprocess.Popen, dict[int, str]]:
    """Start ``tandem up`` on a long run; return it and its children once the control API answers."""
    port = free_port()
    cfg = {"run": {"name": name, "total_steps": 50, "checkpoint_root": str(tmp_path / "ckpt"),
                   "output_dir": str(tmp_path / "runs")},
           "api": {"port": port},
           "environment": {"name": "tictactoe", "group_size": 2, "roles": {"X": "A", "O": "B"}},
           "agents": {a: {"model_path": str(model), "groups_per_batch": 2} for a in ("A", "B")}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    return proc, _children(proc.pid)


def _all_gone(children: dict[int, str]) -> None:
    for pid, cmd in children.items():
        alive = Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
        assert not alive, f"child {pid} ({cmd}) outlived the launcher"


@pytest.mark.slow
def test_a_dying_child_stops_every_service_and_is_named(tmp_path, tiny_model_dir):
    proc, children = _start_run(tmp_path, tiny_model_dir, "dies")
    try:
        victim = next(pid for pid, cmd in children.items() if "services.buffer" in cmd and "--agent A" in cmd)
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "buffer.A died (exit code -9)" in out
    _all_gone(children)


@pytest.mark.slow
def test_sigterm_stops_every_service_and_the_embedded_redis(tmp_path, tiny_model_dir):
    proc, children = _start_run(tmp_path, tiny_model_dir, "term")
    try:
        assert any("valkey" in cmd or "redis-server" in cmd for cmd in children.values()), children
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:]
    assert "stopping every service" in out
    _all_gone(children)


def test_preflight_names_fields_that_claim_one_port():
    from services.contracts.config import parse_config
    from services.launcher.preflight import port_clashes

    cfg = parse_config({"run": {"name": "p"}, "api": {"port": 31000},
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
                        "agents": {"A": {"model_path": "m", "router_port": 31000, "engine_base_port": 31010,
                                         "num_engines": 2},
                                   "B": {"model_path": "m", "engine_base_port": 31011}}})
    assert port_clashes(cfg) == ["api.port and agents.A.router_port: both use port 31000",
                                 "agents.A.engine_base_port and agents.B.engine_base_port: both use port 31011"]
