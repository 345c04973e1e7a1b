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


@pytest.mark.slow
def test_a_dying_child_stops_every_service_and_is_named(tmp_path, tiny_model_dir):
    port = free_port()
    cfg = {"run": {"name": "dies", "total_steps": 50, "checkpoint_root": str(tmp_path / "ckpt"),
                   "output_dir": str(tmp_path / "runs")},
           "api": {"port": port},
           "environment": {"name": "tictactoe", "group_size": 2, "roles": {"X": "A", "O": "B"}},
           "agents": {a: {"model_path": str(tiny_model_dir), "groups_per_batch": 2} for a in ("A", "B")}}
    path = tmp_path / "dies.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        children = _children(proc.pid)
        victim = next(pid for pid, cmd in children.items() if "services.buffer" in cmd and "--agent A" in cmd)
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "buffer.A died (exit code -9)" in out
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
