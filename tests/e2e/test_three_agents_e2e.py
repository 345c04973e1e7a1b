"""The three-role support desk through ``tandem up`` with three training agents (slow).

N > 2 training agents end to end (docs/architecture.md §8, issue 15.5): configs/support_desk.yaml
(customer A, agent B, manager C), made small, on the demo-sized tiny model. Every agent reaches
``total_steps`` weight versions, and each trainer trained only on its own agent's samples, from its
own agent's engine, in its own agent's role. The run's Redis data (AOF) is reopened afterwards to
read the streams, as in test_e2e.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis
import yaml

from services.common.embedded_redis import EmbeddedRedis, free_port
from services.contracts.codec import FIELD, decode
from services.contracts.messages import Batch, GenerateReply
from tests.helpers import REPO, launch_up

pytestmark = pytest.mark.slow
TOTAL_STEPS = 2
ROLES = {"customer": "A", "agent": "B", "manager": "C"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    d = tmp_path_factory.mktemp("three")
    cfg = yaml.safe_load((REPO / "configs" / "support_desk.yaml").read_text())
    cfg["run"].update(total_steps=TOTAL_STEPS, concurrent_episodes=8, checkpoint_root=str(d / "ckpt"),
                      output_dir=str(d / "runs"), trim_interval_s=0)  # keep every stream entry for the checks
    cfg["api"]["port"] = free_port()
    cfg["environment"].update(group_size=4)
    cfg["environment"]["eval"]["episodes"] = 2
    for agent in cfg["agents"].values():
        agent.update(model_path=str(tiny_model_dir), groups_per_batch=1)
        agent["sampling"]["max_new_tokens"] = 8
    path = d / "support_desk.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with open(d / "launcher.log", "wb") as log:
        proc = launch_up(path, stdout=log)
        try:
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    observed: dict = {"returncode": proc.returncode, "log": (d / "launcher.log").read_text(errors="replace")}
    assert proc.returncode == 0, observed["log"][-4000:]
    data = d / "redis-copy"
    shutil.copytree(d / "runs" / "support_desk" / "redis", data)
    with EmbeddedRedis(data_dir=data) as server:
        client = redis.Redis.from_url(server.url)
        key = "tandem:support_desk"
        observed["batches"] = {a: [decode(f[FIELD], Batch) for _, f in client.xrange(f"{key}:batches:{a}")]
                               for a in ROLES.values()}
        observed["replies"] = {r.id: r for _, f in client.xrange(f"{key}:replies:coordinator")
                               if (r := decode(f[FIELD], GenerateReply))}
        observed["train_log"] = {a: [json.loads(x) for x in client.lrange(f"{key}:trainer:{a}:log", 0, -1)]
                                 for a in ROLES.values()}
        observed["deadletters"] = client.xlen(f"{key}:deadletter")
        client.close()
    observed["summary"] = json.loads((d / "runs" / "support_desk" / "summary.json").read_text())
    observed["plot"] = d / "runs" / "support_desk" / "rewards.png"
    return observed


def test_every_agent_reaches_total_steps(run: dict) -> None:
    summary = run["summary"]
    assert summary["phase"] == "done" and summary["episodes"] > 0
    assert sorted(summary["agents"]) == sorted(ROLES.values())
    for agent in ROLES.values():
        a = summary["agents"][agent]
        assert a["weight_versions"] == TOTAL_STEPS and a["steps"] == TOTAL_STEPS, a
        assert isinstance(a["reward_first_quarter"], float)
        assert isinstance(a["eval_start"], float) and isinstance(a["eval_end"], float)
        assert [r["version"] for r in run["train_log"][agent]] == list(range(1, TOTAL_STEPS + 1))
    assert run["deadletters"] == 0
    assert run["plot"].stat().st_size > 1000  # the report's plot draws the three agents
    assert "Traceback" not in run["log"], run["log"][-4000:]


def test_each_trainer_trained_only_its_own_agents_samples(run: dict) -> None:
    role_of = {a: r for r, a in ROLES.items()}
    for agent in ROLES.values():
        trained = [sid for r in run["train_log"][agent] for sid in r["sample_ids"]]
        assert trained and len(trained) == len(set(trained)), "a sample was trained on twice"
        samples = {s.id: s for b in run["batches"][agent] for s in b.samples}
        assert set(trained) <= set(samples)
        for sid in trained:
            s = samples[sid]
            assert s.agent == agent and s.role == role_of[agent]
            assert s.engines and all(e == f"{agent}-0" for e in s.engines)
            for rid in s.reply_ids:
                assert run["replies"][rid].agent == agent and run["replies"][rid].engine == f"{agent}-0"
