"""A short full run through ``tandem up``: every service as a real process.

Checks what the design promises end to end: each trainer trained only on its
own agent's samples from its own agent's engines; trajectories are
token-exact (the ids and logprobs the engines returned are exactly what was
trained on, the loss mask exactly on them); weight versions on samples rise;
pause/resume through the HTTP API stops and restarts new episodes; bad HTTP
requests get a 4xx that says what is wrong. The run's Redis data (AOF) is
reopened afterwards to read the streams.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import httpx
import pytest
import redis
import yaml

from services.common.embedded_redis import EmbeddedRedis, free_port
from services.contracts.codec import FIELD, decode
from services.contracts.messages import Batch, GenerateReply
from tests.helpers import launch_up, wait_until

pytestmark = pytest.mark.slow
TOTAL_STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory, warm_model_dir):
    d = tmp_path_factory.mktemp("e2e")
    port = free_port()
    cfg = {
        "run": {"name": "e2e", "total_steps": TOTAL_STEPS, "concurrent_episodes": 16,
                "checkpoint_root": str(d / "ckpt"), "output_dir": str(d / "runs"),
                "trim_interval_s": 0},  # keep every stream entry: the checks below read them all
        "api": {"port": port},
        "environment": {"name": "tictactoe", "group_size": 4, "roles": {"X": "A", "O": "B"},
                        "alternate_roles": True, "eval": {"episodes": 8}},
        "agents": {
            "A": {"model_path": str(warm_model_dir), "groups_per_batch": 2, "max_staleness": 0,
                  "sampling": {"max_new_tokens": 4}},
            "B": {"model_path": str(warm_model_dir), "groups_per_batch": 2, "max_staleness": 1,
                  "sampling": {"max_new_tokens": 4}},
        },
    }
    if os.environ.get("TANDEM_E2E_LORA") == "1":  # the same run with adapter sync (LoRA on both agents)
        for acfg in cfg["agents"].values():
            acfg["lora"] = {"r": 4, "alpha": 8}
    cfg_path = d / "e2e.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = open(d / "launcher.log", "wb")
    proc = launch_up(cfg_path, stdout=log)
    api = f"http://127.0.0.1:{port}"
    observed: dict = {}
    try:
        wait_until(lambda: httpx.get(f"{api}/health", timeout=2).status_code == 200, 240, "the control API", proc)
        wait_until(lambda: httpx.get(f"{api}/v1/status", timeout=2).json()["phase"] == "training", 240,
                   "training to start", proc)
        assert httpx.post(f"{api}/v1/pause", timeout=5).json()["paused"] is True
        observed["at_pause"] = httpx.get(f"{api}/v1/status", timeout=2).json()

        def settled():
            st = httpx.get(f"{api}/v1/status", timeout=2).json()
            return st if all(a["groups"]["in_flight"] == 0 for a in st["agents"].values()) else None

        st = wait_until(settled, 120, "the groups in flight at the pause to finish", proc)
        time.sleep(2.0)
        st2 = httpx.get(f"{api}/v1/status", timeout=2).json()
        observed["paused"] = (st, st2)
        observed["bad_limit"] = httpx.get(f"{api}/v1/episodes", params={"limit": 0}, timeout=5)
        observed["bad_id"] = httpx.get(f"{api}/v1/episodes/no-such-episode", timeout=5)
        observed["bad_agent"] = httpx.get(f"{api}/v1/metrics", params={"agent": "Z"}, timeout=5)
        observed["episodes"] = httpx.get(f"{api}/v1/episodes", params={"limit": 5}, timeout=5).json()
        assert httpx.post(f"{api}/v1/resume", timeout=5).json()["paused"] is False
        observed["resumed"] = wait_until(
            lambda: (s := httpx.get(f"{api}/v1/status", timeout=2).json())["episodes"] > st2["episodes"] and s,
            60, "episodes after resume", proc)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        log.close()
    observed["returncode"] = proc.returncode
    observed["log"] = (d / "launcher.log").read_text(errors="replace")
    data = d / "redis-copy"
    shutil.copytree(d / "runs" / "e2e" / "redis", data)
    with EmbeddedRedis(data_dir=data) as server:
        client = redis.Redis.from_url(server.url)
        observed["batches"] = {a: [decode(f[FIELD], Batch) for _, f in client.xrange(f"tandem:e2e:batches:{a}")]
                               for a in ("A", "B")}
        observed["replies"] = {r.id: r for _, f in client.xrange("tandem:e2e:replies:coordinator")
                               if (r := decode(f[FIELD], GenerateReply))}
        observed["train_log"] = {a: [json.loads(x) for x in client.lrange(f"tandem:e2e:trainer:{a}:log", 0, -1)]
                                 for a in ("A", "B")}
        observed["deadletters"] = client.xlen("tandem:e2e:deadletter")
        client.close()
    observed["summary"] = json.loads((d / "runs" / "e2e" / "summary.json").read_text())
    observed["plot"] = d / "runs" / "e2e" / "rewards.png"
    return observed


def test_run_finishes_and_reports(run):
    assert run["returncode"] == 0, run["log"][-3000:]
    summary = run["summary"]
    for agent in ("A", "B"):
        a = summary["agents"][agent]
        assert a["weight_versions"] == TOTAL_STEPS and a["steps"] == TOTAL_STEPS
        for key in ("reward_first_quarter", "reward_last_quarter", "eval_start", "eval_end"):
            assert isinstance(a[key], float)
    assert run["plot"].stat().st_size > 1000
    assert run["deadletters"] == 0


def test_each_trainer_trained_only_its_own_agents_samples(run):
    for agent in ("A", "B"):
        log = run["train_log"][agent]
        assert [r["version"] for r in log] == list(range(1, TOTAL_STEPS + 1))
        trained = {sid for r in log for sid in r["sample_ids"]}
        batches = run["batches"][agent]
        samples = {s.id: s for b in batches for s in b.samples}
        assert trained <= set(samples)
        for sid in trained:
            s = samples[sid]
            assert s.agent == agent
            assert s.engines and all(e == f"{agent}-0" for e in s.engines)
            for rid in s.reply_ids:
                assert run["replies"][rid].agent == agent and run["replies"][rid].engine == f"{agent}-0"
        all_trained = [sid for r in log for sid in r["sample_ids"]]
        assert len(all_trained) == len(set(all_trained)), "a sample was trained on twice"


def test_trajectories_are_token_exact(run):
    checked = 0
    for agent in ("A", "B"):
        for batch in run["batches"][agent]:
            for s in batch.samples:
                replies = [run["replies"][rid] for rid in s.reply_ids]
                # the loss mask's runs are exactly the engine replies, in order
                runs, i = [], 0
                while i < len(s.tokens):
                    if s.loss_mask[i]:
                        j = i
                        while j < len(s.tokens) and s.loss_mask[j]:
                            j += 1
                        runs.append((i, j))
                        i = j
                    else:
                        i += 1
                assert len(runs) == len(replies)
                for (i, j), reply in zip(runs, replies, strict=True):
                    assert s.tokens[i:j] == reply.output_ids
                    assert s.rollout_logprobs[i:j] == reply.output_logprobs
                    assert all(lp < 0 or lp == 0 for lp in reply.output_logprobs)
                assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True) if not m)
                assert s.weight_versions == [r.weight_version for r in replies]
                checked += 1
    assert checked >= TOTAL_STEPS * 2 * 2


def test_weight_versions_on_samples_rise(run):
    for agent in ("A", "B"):
        batches = sorted(run["batches"][agent], key=lambda b: b.weight_version)
        firsts = [min(s.min_weight_version for s in b.samples) for b in batches]
        assert firsts == sorted(firsts)
        assert firsts[-1] > firsts[0]
    # agent A is on-policy: batch k is generated wholly by version k-1
    for b in run["batches"]["A"]:
        assert {v for s in b.samples for v in s.weight_versions} == {b.weight_version - 1}


def test_pause_stops_new_episodes_and_resume_restarts_them(run):
    at_pause = run["at_pause"]
    before, after = run["paused"]
    assert at_pause["paused"] and before["paused"] and after["paused"]
    # groups were running when the pause came; they finished, and nothing new started for 2 s
    assert any(a["groups"]["in_flight"] + a["groups"]["kept"] > 0 for a in at_pause["agents"].values())
    assert after["episodes"] == before["episodes"], "episodes started while paused"
    for name, a in after["agents"].items():
        assert a["groups"] == before["agents"][name]["groups"]
        assert a["groups"]["in_flight"] == 0
    assert run["resumed"]["episodes"] > after["episodes"]


def test_bad_http_requests_get_a_4xx_that_says_why(run):
    bad_limit = run["bad_limit"]
    assert bad_limit.status_code == 422
    assert bad_limit.json()["errors"][0]["field"] == "query.limit"
    assert run["bad_id"].status_code == 404 and "no-such-episode" in run["bad_id"].json()["detail"]
    assert run["bad_agent"].status_code == 404 and "'Z'" in run["bad_agent"].json()["detail"]
    assert run["episodes"]["total"] >= 1
