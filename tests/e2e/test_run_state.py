"""Run state under the launcher: a run with state is never wiped silently; it is continued only with --resume and
wiped only with --fresh; a Ctrl-C'd run resumes to its end with every step once and no sample trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.embedded_redis import free_port
from tests.e2e.launcher_runs import all_gone, run_config, start_run, steps_done, stop_run, wait_for
from tests.helpers import launch_up, run_up

REPO = Path(__file__).resolve().parents[2]


def test_up_refuses_a_run_that_has_state_and_touches_nothing(tmp_path, tiny_model_dir, redis_url):
    path, _ = run_config(tmp_path, tiny_model_dir, "kept")
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
    path, _ = run_config(tmp_path, tiny_model_dir, "nothing")
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
    proc, children = start_run(tmp_path, tiny_model_dir, "again", "--fresh")
    try:
        assert proc.poll() is None
        assert not stale.exists() and not (tmp_path / "runs" / "again" / "summary.json").exists()
        assert (tmp_path / "runs" / "again" / "redis").is_dir()
    finally:
        assert stop_run(proc) == 130
    all_gone(children)


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
    end evaluation. Two agents on the embedded Valkey; agent A alone on the external Redis (what differs there is
    where the state is kept, not how many agents keep it)."""
    total = 4
    agents = ("A", "B") if redis == "embedded" else ("A",)
    extra = {"redis_url": request.getfixturevalue("redis_url")} if redis == "external" else {}
    log = tmp_path / "launcher.log"
    path, _ = run_config(tmp_path, tiny_model_dir, "resumed", agents=agents, total_steps=total)
    data = yaml.safe_load(path.read_text())
    data.update(extra)
    data["environment"]["alternate_roles"] = True  # the untrained model ends games early: both must move first
    path.write_text(yaml.safe_dump(data))
    proc = launch_up(path, stdout=log.open("w"), text=True, new_session=True)
    proc.api = f"http://127.0.0.1:{data['api']['port']}"  # type: ignore[attr-defined]
    try:
        wait_for(lambda: steps_done(proc) >= 2, 400, "two training steps", proc, log)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        stop_run(proc, signal.SIGKILL)
    assert "--resume" in log.read_text()
    coordinator = (tmp_path / "runs" / "resumed" / "logs" / "coordinator.log").read_text()
    assert "cannot record group" not in coordinator and "ConnectionError" not in coordinator, coordinator[-3000:]
    res = subprocess.run([sys.executable, "-m", "services.launcher.cli", "up", str(path), "--resume"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "resumed" / "summary.json").read_text())
    logs = _train_logs("resumed", extra.get("redis_url"), tmp_path / "runs" / "resumed" / "redis")
    assert sorted(summary["agents"]) == list(agents)
    for agent in agents:
        a = summary["agents"][agent]
        assert a["weight_versions"] == total and a["steps"] == total, summary
        assert isinstance(a["eval_end"], float)
        assert [r["version"] for r in logs[agent]] == list(range(1, total + 1))
        trained = [sid for r in logs[agent] for sid in r["sample_ids"]]
        assert len(trained) == len(set(trained)), "a sample was trained twice"
