"""A short run with every service as a real process, two faults injected by the test:

* the STALL test: one of agent A's samples is dead-lettered (replaced, while A's buffer is
  down, by a copy that fails validation); its group is abandoned after ``run.group_timeout_s``
  with that reason and the run completes;
* the coordinator is SIGKILLed mid-training and restarted (as any supervisor would): the run
  completes with exactly ``total_steps`` versions per agent, the start evaluation is not re-run,
  and ``summary.json`` counts every step and version.

Prints the time from the kill to the control API answering and to the first new episode.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from services.common.embedded_redis import EmbeddedRedis, free_port
from services.contracts.codec import FIELD, decode, encode
from services.contracts.config import load_config
from services.contracts.messages import Batch, Sample
from services.launcher.processes import ProcessGroup, child_env, python_module
from services.launcher.up import start_services
from tests.helpers import wait_until

pytestmark = pytest.mark.slow
TOTAL_STEPS = 4
TIMEOUT_S = 60.0


def _wait(predicate, timeout: float, what: str):
    return wait_until(predicate, timeout, what, errors=(httpx.HTTPError, redis.RedisError, KeyError, ValueError))


def write_config(d: Path, port: int, model: Path) -> Path:
    agent = {"model_path": str(model), "groups_per_batch": 2, "sampling": {"max_new_tokens": 4}}
    cfg = {"run": {"name": "crash", "total_steps": TOTAL_STEPS, "concurrent_episodes": 16,
                   "checkpoint_root": str(d / "ckpt"), "output_dir": str(d / "runs"), "trim_interval_s": 0,
                   "group_timeout_s": TIMEOUT_S},
           "api": {"port": port},
           "environment": {"name": "tictactoe", "group_size": 4, "roles": {"X": "A", "O": "B"},
                           "alternate_roles": True, "eval": {"episodes": 8}},
           "agents": {"A": {**agent, "max_staleness": 0}, "B": {**agent, "max_staleness": 1}}}
    path = d / "crash.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def dead_letter_one_sample(client: redis.Redis, group: ProcessGroup, path: Path) -> str:
    """Kill A's buffer, wait for a sample it was not delivered, swap that entry for a copy that fails
    validation, and restart the buffer (as a supervisor would): the copy is dead-lettered at once."""
    buffer = next(c for c in group.children if c.name == "buffer.A")
    stream = "tandem:crash:samples:A"
    _wait(lambda: client.exists(stream) and any(g["name"] == b"buffer" for g in client.xinfo_groups(stream)), 300,
          "A's buffer to read its stream")
    buffer.proc.send_signal(signal.SIGKILL)
    buffer.proc.wait(10)

    def undelivered():
        last = next(g for g in client.xinfo_groups(stream) if g["name"] == b"buffer")["last-delivered-id"]
        newer = client.xrange(stream, min=b"(" + last)
        return newer[-1] if newer else None

    entry_id, fields = _wait(undelivered, 600, "a sample A's buffer was not delivered")
    sample = decode(fields[FIELD], Sample)
    bad = Sample.model_construct(**{**dict(sample), "loss_mask": [0] * len(sample.tokens)})
    with client.pipeline(transaction=True) as pipe:
        pipe.xdel(stream, entry_id)
        pipe.xadd(stream, {FIELD: encode(bad)})
        pipe.execute()
    group.start("buffer.A", python_module("services.buffer", "--config", str(path), "--agent", "A"))
    return sample.group_id


@pytest.fixture(scope="module")
def run(tmp_path_factory, warm_model_dir):
    d = tmp_path_factory.mktemp("crash")
    port = free_port()
    path = write_config(d, port, warm_model_dir)
    cfg = load_config(path)
    api = f"http://127.0.0.1:{port}"
    observed: dict = {}
    server = EmbeddedRedis(data_dir=d / "redis").start()
    client = redis.Redis.from_url(server.url)
    group = ProcessGroup(d / "logs", child_env({"TANDEM_REDIS_URL": server.url}), lambda name, line: None)
    status = lambda: httpx.get(f"{api}/v1/status", timeout=2).json()  # noqa: E731
    try:
        start_services(cfg, str(path), group, port)
        observed["poisoned_group"] = dead_letter_one_sample(client, group, path)
        _wait(lambda: min(a["step"] for a in status()["agents"].values()) >= 2, 900, "step 2 of both agents")
        coord = next(c for c in group.children if c.name == "coordinator")
        before = status()
        coord.proc.send_signal(signal.SIGKILL)
        killed = time.time()
        coord.proc.wait(10)
        restarted = group.start("coordinator", python_module("services.coordinator", "--config", str(path),
                                                             "--port", str(port)))
        _wait(lambda: httpx.get(f"{api}/health", timeout=2).status_code == 200, 300, "the restarted API")
        observed["kill_to_api_s"] = time.time() - killed
        _wait(lambda: status()["episodes"] > before["episodes"], 300, "a new episode after the restart")
        observed["kill_to_progress_s"] = time.time() - killed
        observed["before_kill"] = before
        observed["returncode"] = restarted.proc.wait(900)
        observed["train_log"] = {a: [json.loads(x) for x in client.lrange(f"tandem:crash:trainer:{a}:log", 0, -1)]
                                 for a in ("A", "B")}
        observed["ledger"] = {a: {k.decode(): json.loads(v) for k, v in
                                  client.hgetall(f"tandem:crash:coord:ledger:{a}").items()} for a in ("A", "B")}
        observed["verdicts"] = {a: {k.decode(): v.decode() for k, v in
                                    client.hgetall(f"tandem:crash:buffer:{a}:verdicts").items()} for a in ("A", "B")}
        observed["deadletters"] = client.xlen("tandem:crash:deadletter")
        observed["batches"] = {a: [decode(f[FIELD], Batch) for _, f in client.xrange(f"tandem:crash:batches:{a}")]
                               for a in ("A", "B")}
    finally:
        group.stop_all()
        client.close()
        server.stop()
    observed["summary"] = json.loads((d / "runs" / "crash" / "summary.json").read_text())
    observed["log"] = (d / "logs" / "coordinator.log").read_text(errors="replace")
    print(f"\ncoordinator SIGKILL -> API answering: {observed['kill_to_api_s']:.1f}s, "
          f"-> first new episode: {observed['kill_to_progress_s']:.1f}s")
    return observed


def test_the_restarted_coordinator_completes_the_run_and_reports_it(run):
    assert run["returncode"] == 0, run["log"][-3000:]
    summary = run["summary"]
    assert summary["phase"] == "done"
    for agent in ("A", "B"):
        a = summary["agents"][agent]
        assert (a["steps"], a["weight_versions"], a["last_weight_version"]) == (TOTAL_STEPS,) * 3
        assert isinstance(a["eval_start"], float) and isinstance(a["eval_end"], float)
        log = run["train_log"][agent]
        assert [r["version"] for r in log] == list(range(1, TOTAL_STEPS + 1))
        trained = [sid for r in log for sid in r["sample_ids"]]
        assert len(trained) == len(set(trained)), "a sample was trained on twice"
    assert [e["label"] for e in summary["evals"]] == ["start", "end"]  # the start eval ran once
    assert summary["episodes"] > run["before_kill"]["episodes"]


def test_every_group_ends_in_one_state_and_the_dead_lettered_one_is_abandoned(run):
    assert run["deadletters"] == 1
    poisoned = run["poisoned_group"]
    assert run["verdicts"]["A"][poisoned].startswith("abandoned:dead-lettered sample: invalid Sample")
    assert run["summary"]["agents"]["A"]["abandon_reasons"].get("dead-lettered sample", 0) >= 1
    for agent in ("A", "B"):
        verdicts = run["verdicts"][agent]
        for gid, entry in run["ledger"][agent].items():
            assert entry["state"] in ("emitted", "abandoned"), (gid, entry)  # never left "playing"
            if entry["state"] == "abandoned":
                assert entry["reason"] and gid not in verdicts  # decided here, not also by the buffer
        assert set(verdicts) <= set(run["ledger"][agent])  # every verdict is on a group the ledger launched
        group_of = {s.id: s.group_id for b in run["batches"][agent] for s in b.samples}
        trained_groups = {group_of[sid] for r in run["train_log"][agent] for sid in r["sample_ids"]}
        assert len(trained_groups) == TOTAL_STEPS * 2  # groups_per_batch whole groups per step
        assert all(verdicts[g] == "kept" for g in trained_groups)  # never a dropped or abandoned one
