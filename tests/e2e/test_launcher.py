"""The local launcher: a bad config fails before anything starts; a dying child (or the embedded Valkey)
is restarted and the run goes on, within the restart budget; past it the run stops naming the service;
nothing outlives the launcher, even a SIGKILLed one. (Run state, --resume and --fresh: test_run_state.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.launcher_runs import all_gone, children_of, logged_run, start_run, steps_done, stop_run, victim, wait_for

REPO = Path(__file__).resolve().parents[2]


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
def test_a_killed_service_is_restarted_and_the_run_goes_on(tmp_path, tiny_model_dir):
    proc, children, log = logged_run(tmp_path, tiny_model_dir, "restarts")
    try:
        wait_for(lambda: steps_done(proc) >= 1, 240, "training step", proc, log)
        for what in ("services.buffer --config", "services.trainer --config"):
            os.kill(victim(children_of(proc.pid), what, "--agent A"), signal.SIGKILL)
            before = steps_done(proc)
            back = wait_for(lambda b=before: steps_done(proc) > b, 240, f"step after killing {what}", proc, log)
            print(f"{what}: progress again {back:.1f}s after SIGKILL")
        out = log.read_text()
        assert "buffer.A died (exit code -9); restarting it" in out and "buffer.A restarted (restart 1)" in out
        assert "trainer.A died (exit code -9); restarting it" in out
        assert stop_run(proc) == 130
    finally:
        stop_run(proc, signal.SIGKILL)
    summary = tmp_path / "runs" / "restarts" / "summary.json"
    if summary.exists():  # written when the coordinator reports on stop
        assert json.loads(summary.read_text())["restarts"]["buffer.A"] == 1
    all_gone(children)


@pytest.mark.slow
def test_past_the_restart_budget_the_run_stops_naming_the_service(tmp_path, tiny_model_dir):
    proc, children, log = logged_run(tmp_path, tiny_model_dir, "dies", max_restarts=1)
    try:
        os.kill(victim(children, "services.buffer --config", "--agent A"), signal.SIGKILL)
        wait_for(lambda: "buffer.A restarted (restart 1)" in log.read_text(), 60, "restart", proc, log)
        os.kill(victim(children_of(proc.pid), "services.buffer --config", "--agent A"), signal.SIGKILL)
        assert proc.wait(60) == 1
    finally:
        stop_run(proc, signal.SIGKILL)
    out = " ".join(log.read_text().split())
    assert "buffer.A died (exit code -9) after 1 restart(s) within 600s (run.max_restarts=1); stopping the run" \
        in out, out[-3000:]
    assert f"`tandem up {tmp_path / 'dies.yaml'} --resume` continues the run" in out, out[-3000:]
    all_gone(children)


@pytest.mark.slow
def test_a_killed_valkey_is_named_and_restarted_on_its_aof(tmp_path, tiny_model_dir):
    proc, children, log = logged_run(tmp_path, tiny_model_dir, "valkey")
    try:
        wait_for(lambda: steps_done(proc) >= 1, 240, "training step", proc, log)
        valkey = victim(children, "valkey")
        before = steps_done(proc)
        os.kill(valkey, signal.SIGKILL)
        codes: set[int] = set()

        def restarted_and_status() -> bool:  # /v1/status through the outage: never a 500
            with contextlib.suppress(httpx.HTTPError):
                codes.add(httpx.get(f"{proc.api}/v1/status", timeout=2).status_code)  # type: ignore[attr-defined]
            return "redis restarted (restart 1)" in log.read_text()

        wait_for(restarted_and_status, 60, "Valkey restart", proc, log)
        back = wait_for(lambda: steps_done(proc) > before, 240, "step after killing Valkey", proc, log)
        assert codes == {200}, codes
        print(f"valkey: progress again {back:.1f}s after SIGKILL")
        assert steps_done(proc) >= before  # the AOF kept the run's state: no step went back
        assert stop_run(proc) == 130
    finally:
        stop_run(proc, signal.SIGKILL)
    out = log.read_text()
    assert "redis died (exit code -9); restarting it" in out
    deaths = [line for line in out.splitlines() if " died (exit code " in line]
    assert len(deaths) == 1 and deaths[0].startswith("redis died"), deaths  # Valkey's death is Valkey's alone
    all_gone(children)


def _listening(pids: set[int]) -> dict[str, str]:
    """Listening TCP sockets of ``pids``: 'address:port' -> the owner's command line."""
    owner = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    owner[link[8:-1]] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
        except OSError:
            continue
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in owner:  # LISTEN
                addr, port = f[1].split(":")
                ip = ".".join(str(b) for b in reversed(bytes.fromhex(addr))) if len(addr) == 8 else addr
                out[f"{ip}:{int(port, 16)}"] = owner[f[9]]
    return out


@pytest.mark.slow
def test_a_sigkilled_launcher_leaves_no_valkey_and_no_service_behind(tmp_path, tiny_model_dir):
    proc, children = start_run(tmp_path, tiny_model_dir, "orphans")
    grandchildren = {pid: cmd for child in children for pid, cmd in children_of(child).items()}
    assert any("valkey" in cmd or "redis-server" in cmd for cmd in children.values()), children
    assert any("sglang" in cmd and "router" in cmd for cmd in grandchildren.values()), grandchildren
    listening = _listening({proc.pid, *children, *grandchildren})
    assert len(listening) >= 5, listening  # Valkey, the API, A's router, its metrics and its engine
    assert all(a.startswith("127.0.0.1:") for a in listening), listening  # nothing beyond the loopback
    proc.kill()
    proc.wait(30)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            all_gone({**children, **grandchildren})
            break
        except AssertionError:
            time.sleep(0.5)
    all_gone({**children, **grandchildren})


@pytest.mark.slow
def test_sigterm_stops_every_service_and_the_embedded_redis(tmp_path, tiny_model_dir):
    proc, children = start_run(tmp_path, tiny_model_dir, "term")
    try:
        assert any("valkey" in cmd or "redis-server" in cmd for cmd in children.values()), children
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:]
    assert "stopping every service" in out
    all_gone(children)


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


def test_a_port_left_in_time_wait_is_free_and_a_listening_one_is_not():
    """A run just stopped leaves its API's connections in TIME_WAIT; ``--resume`` at once must not call the
    port in use (the servers bind with SO_REUSEADDR), while a port a server listens on still is."""
    import socket

    from services.launcher.preflight import port_is_free

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    assert not port_is_free("127.0.0.1", port)  # listening
    conn.close()  # the server's side closes first: it holds the port in TIME_WAIT
    time.sleep(0.05)
    client.close()
    server.close()
    assert port_is_free("127.0.0.1", port)
