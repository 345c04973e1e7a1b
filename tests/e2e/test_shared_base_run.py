"""A short ``tandem up`` of configs/shared_base.yaml (B shares A's engines, both train LoRA on the warm demo
model): one engine process and one router serve both agents; each agent's versions are loaded and recorded;
every reply names the shared engine and its own agent's version; the engine, killed mid-run, comes back (A's
rollout restarts it with both agents' adapters) and both agents' turns go on under their own versions until the
run finishes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
import yaml

from services.common.embedded_redis import EmbeddedRedis, free_port
from services.contracts.codec import FIELD, decode
from services.contracts.messages import GenerateReply
from tests.helpers import launch_up, wait_until

pytestmark = pytest.mark.slow
TOTAL_STEPS = 4
REPO = Path(__file__).resolve().parents[2]


def fleet_processes(launcher: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The launcher's engine and router processes (its descendants)."""
    out: dict[str, list[psutil.Process]] = {"engine": [], "router": []}
    for p in launcher.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for kind, marker in (("engine", "services.engine"), ("router", "sglang_router")):
            if marker in cmd:
                out[kind].append(p)
    return out


def status(api: str) -> dict[str, Any]:
    return httpx.get(f"{api}/v1/status", timeout=2).json()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, warm_model_dir: Path) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("shared_run")
    cfg = yaml.safe_load((REPO / "configs" / "shared_base.yaml").read_text())
    port = free_port()
    cfg["run"] |= {"total_steps": TOTAL_STEPS, "concurrent_episodes": 4, "checkpoint_root": str(d / "ckpt"),
                   "output_dir": str(d / "runs"), "trim_interval_s": 0}
    cfg["api"]["port"] = port
    cfg["environment"] |= {"group_size": 4, "eval": {"episodes": 4, "opponents": ["random"]}}
    for acfg in cfg["agents"].values():
        acfg |= {"model_path": str(warm_model_dir), "groups_per_batch": 1}
    path = d / "shared.yaml"
    path.write_text(yaml.safe_dump(cfg))
    api, seen = f"http://127.0.0.1:{port}", {}
    with open(d / "launcher.log", "wb") as log:
        proc = launch_up(path, stdout=log)
        try:
            launcher = psutil.Process(proc.pid)
            try:
                wait_until(lambda: all(a["weight_version"] >= 1 for a in status(api)["agents"].values()), 300,
                           "both agents to load version 1", proc)
            except AssertionError as exc:
                raise AssertionError(f"{exc}:\n{(d / 'launcher.log').read_text(errors='replace')[-3000:]}") from None
            fleet = fleet_processes(launcher)  # one group at a time: steps 2-4 are still to play
            seen["fleet"] = {k: len(v) for k, v in fleet.items()}
            seen["rollouts"] = {a: s["rollout"] for a, s in status(api)["agents"].items()}
            seen["killed_at_ms"] = int(time.time() * 1000)
            os.kill(fleet["engine"][0].pid, signal.SIGKILL)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    seen["returncode"] = proc.returncode
    seen["log"] = (d / "launcher.log").read_text(errors="replace")
    data = d / "redis-copy"
    shutil.copytree(d / "runs" / "shared_base" / "redis", data)
    with EmbeddedRedis(data_dir=data) as server:
        client = redis.Redis.from_url(server.url)
        entries = client.xrange("tandem:shared_base:replies:coordinator")  # ids: the ms they were added at
        seen["replies"] = [(int(i.split(b"-")[0]), r) for i, f in entries if (r := decode(f[FIELD], GenerateReply))]
        seen["deadletters"] = client.xlen("tandem:shared_base:deadletter")
        client.close()
    seen["summary"] = json.loads((d / "runs" / "shared_base" / "summary.json").read_text())
    return seen


def test_one_fleet_serves_both_agents_and_survives_an_engine_kill(run: dict[str, Any]) -> None:
    assert run["returncode"] == 0, run["log"][-3000:]
    assert run["fleet"] == {"engine": 1, "router": 1}  # one engine fleet for the two agents
    a, b = run["rollouts"]["A"], run["rollouts"]["B"]
    assert b["router"] == a["router"] and [e["url"] for e in b["engines"]] == [e["url"] for e in a["engines"]]
    for agent in ("A", "B"):
        s = run["summary"]["agents"][agent]
        assert s["steps"] == TOTAL_STEPS and s["published_versions"] == list(range(1, TOTAL_STEPS + 1))
        assert s["loaded_versions"][-1] == TOTAL_STEPS
    assert run["deadletters"] == 0
    assert run["summary"]["restarts"].get("engines.A") == 1  # the fleet's owner restarted the killed engine
    replies = run["replies"]
    assert replies and all(r.error is None and r.engine == "A-0" for _, r in replies)
    for agent in ("A", "B"):  # every reply records a version of its own agent's, before and after the kill
        mine = [(t, r.weight_version) for t, r in replies if r.agent == agent]
        loaded = set(run["summary"]["agents"][agent]["loaded_versions"]) | {0}
        assert {v for _, v in mine} <= loaded
        assert any(t > run["killed_at_ms"] and v >= 1 for t, v in mine), f"no turn of {agent} after the kill"
