"""The local launcher: a bad config fails before anything starts; a dying child (or the embedded Valkey)
is restarted and the run goes on, within the restart budget; past it the run stops naming the service;
nothing outlives the launcher, even a SIGKILLed one; a run with state is continued only with --resume
and wiped only with --fresh."""

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

from services.common.embedded_redis import free_port
from tests.helpers import launch_up, run_up

REPO = Path(__file__).resolve().parents[2]


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


def _config(tmp_path: Path, model: Path, name: str, **run: object) -> tuple[Path, int]:
    port = free_port()
    cfg = {"run": {"name": name, "total_steps": 50, "checkpoint_root": str(tmp_path / "ckpt"),
                   "output_dir": str(tmp_path / "runs"), **run},
           "api": {"port": port},
           "environment": {"name": "tictactoe", "group_size": 2, "roles": {"X": "A", "O": "B"},
                           "eval": {"episodes": 4}},
           "agents": {a: {"model_path": str(model), "groups_per_batch": 2, "max_no_signal_steps": 0}
                      for a in ("A", "B")}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, port


def _start_run(tmp_path: Path, model: Path, name: str, *flags: str, log: Path | None = None,
               **run: object) -> tuple[subprocess.Popen, dict[int, str]]:
    """Start ``tandem up`` on a long run; return it and its children once the control API answers.
    With ``log`` the launcher's output goes to that file (read it with ``log.read_text()``)."""
    path, port = _config(tmp_path, model, name, **run)
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
    while time.time() < deadline and _trained(_children(proc.pid)) < 4:  # a new run's buffers and trainers
        assert proc.poll() is None, log.read_text() if log else ""     # start after its first turn
        time.sleep(0.3)
    return proc, _children(proc.pid)


def _trained(children: dict[int, str]) -> int:
    return sum("services.buffer --config" in cmd or "services.trainer --config" in cmd for cmd in children.values())


def _logged_run(tmp_path: Path, model: Path, name: str,
                **run: object) -> tuple[subprocess.Popen, dict[int, str], Path]:
    """``_start_run`` with the launcher's output in ``tmp_path/launcher.log``, also returned."""
    log = tmp_path / "launcher.log"
    return (*_start_run(tmp_path, model, name, log=log, **run), log)


def _steps(proc: subprocess.Popen) -> int:
    """Training steps done so far, both agents together (0 while the API does not answer)."""
    try:
        status = httpx.get(f"{proc.api}/v1/status", timeout=2).json()  # type: ignore[attr-defined]
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(int(a["step"]) for a in status["agents"].values())


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> float:
    """Seconds until ``cond()`` holds; fails naming ``what`` (with the launcher's output) otherwise."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) waiting for {what}:\n" + \
            log.read_text()[-3000:]
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout:.0f}s:\n" + log.read_text()[-3000:])


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()


def _all_gone(children: dict[int, str]) -> None:
    for pid, cmd in children.items():
        alive = Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
        assert not alive, f"child {pid} ({cmd}) outlived the launcher"


def _victim(children: dict[int, str], *parts: str) -> int:
    return next(pid for pid, cmd in children.items() if all(p in cmd for p in parts))


@pytest.mark.slow
def test_a_killed_service_is_restarted_and_the_run_goes_on(tmp_path, tiny_model_dir):
    proc, children, log = _logged_run(tmp_path, tiny_model_dir, "restarts")
    try:
        _wait_for(lambda: _steps(proc) >= 1, 240, "training step", proc, log)
        for what in ("services.buffer --config", "services.trainer --config"):
            os.kill(_victim(_children(proc.pid), what, "--agent A"), signal.SIGKILL)
            before = _steps(proc)
            back = _wait_for(lambda b=before: _steps(proc) > b, 240, f"step after killing {what}", proc, log)
            print(f"{what}: progress again {back:.1f}s after SIGKILL")
        out = log.read_text()
        assert "buffer.A died (exit code -9); restarting it" in out and "buffer.A restarted (restart 1)" in out
        assert "trainer.A died (exit code -9); restarting it" in out
        assert _stop(proc) == 130
    finally:
        _stop(proc, signal.SIGKILL)
    summary = tmp_path / "runs" / "restarts" / "summary.json"
    if summary.exists():  # written when the coordinator reports on stop
        assert json.loads(summary.read_text())["restarts"]["buffer.A"] == 1
    _all_gone(children)


@pytest.mark.slow
def test_past_the_restart_budget_the_run_stops_naming_the_service(tmp_path, tiny_model_dir):
    proc, children, log = _logged_run(tmp_path, tiny_model_dir, "dies", max_restarts=1)
    try:
        os.kill(_victim(children, "services.buffer --config", "--agent A"), signal.SIGKILL)
        _wait_for(lambda: "buffer.A restarted (restart 1)" in log.read_text(), 60, "restart", proc, log)
        os.kill(_victim(_children(proc.pid), "services.buffer --config", "--agent A"), signal.SIGKILL)
        assert proc.wait(60) == 1
    finally:
        _stop(proc, signal.SIGKILL)
    out = " ".join(log.read_text().split())
    assert "buffer.A died (exit code -9) after 1 restart(s) within 600s (run.max_restarts=1); stopping the run" \
        in out, out[-3000:]
    assert f"`tandem up {tmp_path / 'dies.yaml'} --resume` continues the run" in out, out[-3000:]
    _all_gone(children)


@pytest.mark.slow
def test_a_killed_valkey_is_named_and_restarted_on_its_aof(tmp_path, tiny_model_dir):
    proc, children, log = _logged_run(tmp_path, tiny_model_dir, "valkey")
    try:
        _wait_for(lambda: _steps(proc) >= 1, 240, "training step", proc, log)
        valkey = _victim(children, "valkey")
        before = _steps(proc)
        os.kill(valkey, signal.SIGKILL)
        codes: set[int] = set()

        def restarted_and_status() -> bool:  # /v1/status through the outage: never a 500
            with contextlib.suppress(httpx.HTTPError):
                codes.add(httpx.get(f"{proc.api}/v1/status", timeout=2).status_code)  # type: ignore[attr-defined]
            return "redis restarted (restart 1)" in log.read_text()

        _wait_for(restarted_and_status, 60, "Valkey restart", proc, log)
        back = _wait_for(lambda: _steps(proc) > before, 240, "step after killing Valkey", proc, log)
        assert codes == {200}, codes
        print(f"valkey: progress again {back:.1f}s after SIGKILL")
        assert _steps(proc) >= before  # the AOF kept the run's state: no step went back
        assert _stop(proc) == 130
    finally:
        _stop(proc, signal.SIGKILL)
    out = log.read_text()
    assert "redis died (exit code -9); restarting it" in out
    deaths = [line for line in out.splitlines() if " died (exit code " in line]
    assert len(deaths) == 1 and deaths[0].startswith("redis died"), deaths  # Valkey's death is Valkey's alone
    _all_gone(children)


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
    proc, children = _start_run(tmp_path, tiny_model_dir, "orphans")
    grandchildren = {pid: cmd for child in children for pid, cmd in _children(child).items()}
    assert any("valkey" in cmd or "redis-server" in cmd for cmd in children.values()), children
    assert any("sglang" in cmd and "router" in cmd for cmd in grandchildren.values()), grandchildren
    listening = _listening({proc.pid, *children, *grandchildren})
    assert len(listening) >= 6, listening  # Valkey, the API, per agent a router, its metrics and an engine
    assert all(a.startswith("127.0.0.1:") for a in listening), listening  # nothing beyond the loopback
    proc.kill()
    proc.wait(30)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            _all_gone({**children, **grandchildren})
            break
        except AssertionError:
            time.sleep(0.5)
    _all_gone({**children, **grandchildren})


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


# ---- run state: never wiped silently; --fresh wipes; --resume continues --------------------------------------------

def test_up_refuses_a_run_that_has_state_and_touches_nothing(tmp_path, tiny_model_dir, redis_url):
    path, _ = _config(tmp_path, tiny_model_dir, "kept")
    marker = tmp_path / "ckpt" / "kept" / "v00001" / "model.safetensors"
    marker.parent.mkdir(parents=True)
    marker.write_text("weights")
    res = run_up(path)
    assert res.returncode == 2
    assert "run 'kept' already has state" in res.stderr and "--resume" in res.stderr and "--fresh" in res.stderr
    assert "refused, to keep an earlier run's data" in res.stderr and "invalid config" not in res.stderr
    assert marker.read_text() == "weights" and not (tmp_path / "runs").exists()
    # an unreachable Redis fails the checks before anything is deleted, even with --fresh
    data = yaml.safe_load(path.read_text())
    data["redis_url"] = f"redis://127.0.0.1:{free_port()}/0"
    path.write_text(yaml.safe_dump(data))
    res = run_up(path, "--fresh")
    assert res.returncode == 2 and "redis_url: cannot reach" in res.stderr, res.stderr
    assert marker.read_text() == "weights"
    # keys of an earlier run on an external Redis are state too
    marker.unlink()
    data["redis_url"] = redis_url
    path.write_text(yaml.safe_dump(data))
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_url)
    client.set("tandem:kept:state:A:loaded_version", 3)
    res = run_up(path)
    assert res.returncode == 2 and "keys tandem:kept:*" in res.stderr, res.stderr
    assert client.get("tandem:kept:state:A:loaded_version") == b"3"
    client.close()
    res = run_up(path, "--resume", "--fresh")
    assert res.returncode == 2 and "not allowed with" in res.stderr


def test_resume_needs_state_and_validate_checks_redis(tmp_path, tiny_model_dir):
    path, _ = _config(tmp_path, tiny_model_dir, "nothing")
    res = run_up(path, "--resume")
    assert res.returncode == 2 and "run 'nothing' has no state to resume" in res.stderr
    data = yaml.safe_load(path.read_text())
    data["redis_url"] = "http://not-redis"
    path.write_text(yaml.safe_dump(data))
    res = subprocess.run([sys.executable, "-m", "services.launcher.cli", "validate", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "redis_url: 'http://not-redis' is not a Redis URL" in res.stderr


@pytest.mark.slow
def test_fresh_wipes_the_earlier_run_first(tmp_path, tiny_model_dir):
    stale = tmp_path / "ckpt" / "again" / "v00007"
    stale.mkdir(parents=True)
    (tmp_path / "runs" / "again").mkdir(parents=True)
    (tmp_path / "runs" / "again" / "summary.json").write_text("{}")
    proc, children = _start_run(tmp_path, tiny_model_dir, "again", "--fresh")
    try:
        assert proc.poll() is None
        assert not stale.exists() and not (tmp_path / "runs" / "again" / "summary.json").exists()
        assert (tmp_path / "runs" / "again" / "redis").is_dir()
    finally:
        assert _stop(proc) == 130
    _all_gone(children)


def _train_logs(run: str, redis_url: str | None, data: Path | None) -> dict[str, list[dict]]:
    """Each trainer's log, from the live Redis or from a copy of the embedded one's AOF."""
    import redis as redis_lib

    from services.common.embedded_redis import EmbeddedRedis

    server = None
    if redis_url is None:
        server = EmbeddedRedis(data_dir=data).start()
        redis_url = server.url
    client = redis_lib.Redis.from_url(redis_url)
    try:
        return {a: [json.loads(x) for x in client.lrange(f"tandem:{run}:trainer:{a}:log", 0, -1)] for a in "AB"}
    finally:
        client.close()
        if server is not None:
            server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("redis", ["embedded", "external"])
def test_resume_continues_an_interrupted_run_to_the_end(tmp_path, tiny_model_dir, redis, request):
    """Ctrl-C mid-training (SIGINT to the launcher's whole process group, as a terminal sends it), then --resume:
    the services stop cleanly (the embedded Valkey outlives them), every step once, no sample trained twice, the
    end evaluation."""
    total = 4
    extra = {"redis_url": request.getfixturevalue("redis_url")} if redis == "external" else {}
    log = tmp_path / "launcher.log"
    path, _ = _config(tmp_path, tiny_model_dir, "resumed", total_steps=total)
    data = yaml.safe_load(path.read_text())
    data.update(extra)
    data["environment"]["alternate_roles"] = True  # the untrained model ends games early: both must move first
    path.write_text(yaml.safe_dump(data))
    proc = launch_up(path, stdout=log.open("w"), text=True, new_session=True)
    proc.api = f"http://127.0.0.1:{data['api']['port']}"  # type: ignore[attr-defined]
    try:
        _wait_for(lambda: _steps(proc) >= 2, 400, "two training steps", proc, log)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        _stop(proc, signal.SIGKILL)
    assert "--resume" in log.read_text()
    coordinator = (tmp_path / "runs" / "resumed" / "logs" / "coordinator.log").read_text()
    assert "cannot record group" not in coordinator and "ConnectionError" not in coordinator, coordinator[-3000:]
    res = subprocess.run([sys.executable, "-m", "services.launcher.cli", "up", str(path), "--resume"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "resumed" / "summary.json").read_text())
    logs = _train_logs("resumed", extra.get("redis_url"), tmp_path / "runs" / "resumed" / "redis")
    for agent in "AB":
        a = summary["agents"][agent]
        assert a["weight_versions"] == total and a["steps"] == total, summary
        assert isinstance(a["eval_end"], float)
        assert [r["version"] for r in logs[agent]] == list(range(1, total + 1))
        trained = [sid for r in logs[agent] for sid in r["sample_ids"]]
        assert len(trained) == len(set(trained)), "a sample was trained twice"
