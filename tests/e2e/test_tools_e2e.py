"""The two-agent tool environment (configs/tool_relay.yaml) through ``tandem up``, both agents training (slow).

The researcher's model is the tiny demo model taught, here, to open its turn with a calculator call (a few
hundred supervised steps on its own rendered prompts), so that tool calls really happen in the run. The
transcripts must hold the calls and their results, and the trained samples must carry the tool results as
context (loss mask 0) between the generations (mask 1).
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import redis
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.embedded_redis import EmbeddedRedis, free_port
from services.contracts.codec import FIELD, decode
from services.contracts.messages import Batch
from services.envs.render import ChatRenderer
from services.envs.tool_tasks import ToolRelay
from services.envs.tools.base import ToolBox
from tests.helpers import REPO, launch_up

pytestmark = pytest.mark.slow
TOTAL_STEPS = 2
CALL = "CALL calculator 6*7"
PARAMS = {"tools": {"researcher": ["calculator"]}, "system": {"researcher": "", "buyer": ""},
          "max_tool_calls_per_turn": 1, "max_tool_calls_per_episode": 1}


def teach_the_call(src: Path, dest: Path) -> Path:
    """A copy of the model at ``src`` that replies ``CALL`` to the researcher's first prompt."""
    shutil.copytree(src, dest)
    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest)
    answer = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    rows = []
    for seed in range(8):
        env = ToolRelay(PARAMS, seed)
        prompt = ChatRenderer(tok, ToolBox(("calculator",)).describe()).user_turn(env.observation("researcher"))
        rows.append((prompt, answer))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(400):
        prompt, target = rows[step % len(rows)]
        ids = torch.tensor([prompt + target])
        labels = torch.tensor([[-100] * len(prompt) + target])
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02 and step >= len(rows):
            break
    model.save_pretrained(dest, safe_serialization=True)
    return dest


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    d = tmp_path_factory.mktemp("tools")
    caller = teach_the_call(tiny_model_dir, d / "caller")
    cfg = yaml.safe_load((REPO / "configs" / "tool_relay.yaml").read_text())
    cfg["run"].update(total_steps=TOTAL_STEPS, concurrent_episodes=8, checkpoint_root=str(d / "ckpt"),
                      output_dir=str(d / "runs"), trim_interval_s=0)
    cfg["api"]["port"] = free_port()
    cfg["environment"].update(group_size=4)
    cfg["environment"]["params"].update(PARAMS)
    cfg["environment"]["eval"]["episodes"] = 2
    for name, agent in cfg["agents"].items():
        agent.update(model_path=str(caller if name == "A" else tiny_model_dir), groups_per_batch=1)
        agent["sampling"]["max_new_tokens"] = 24
    path = d / "tool_relay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with open(d / "launcher.log", "wb") as log:
        proc = launch_up(path, stdout=log)
        try:
            proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    observed: dict = {"log": (d / "launcher.log").read_text(errors="replace")}
    assert proc.returncode == 0, observed["log"][-4000:]
    out = d / "runs" / "tool_relay"
    shutil.copytree(out / "redis", d / "redis-copy")
    with EmbeddedRedis(data_dir=d / "redis-copy") as server:
        client = redis.Redis.from_url(server.url)
        key = "tandem:tool_relay"
        observed["batches"] = {a: [decode(f[FIELD], Batch) for _, f in client.xrange(f"{key}:batches:{a}")]
                               for a in ("A", "B")}
        observed["episodes"] = [json.loads(v) for v in client.hgetall(f"{key}:episodes").values()]
        client.close()
    archive = out / "transcripts.jsonl.gz"
    if archive.exists():
        with gzip.open(archive, "rt") as fh:
            observed["episodes"] += [json.loads(line) for line in fh if line.strip()]
    observed["summary"] = json.loads((out / "summary.json").read_text())
    observed["tokenizer"] = AutoTokenizer.from_pretrained(caller)
    return observed


def test_both_agents_train(run: dict) -> None:
    summary = run["summary"]
    assert summary["phase"] == "done" and summary["episodes"] > 0
    for agent in ("A", "B"):
        assert summary["agents"][agent]["steps"] == TOTAL_STEPS, summary["agents"][agent]
        assert run["batches"][agent], agent
    assert "Traceback" not in run["log"], run["log"][-4000:]


def test_the_transcripts_hold_the_calls_and_their_results(run: dict) -> None:
    turns = [t for ep in run["episodes"] for t in ep["turns"] if t["role"] == "researcher" and t["agent"] == "A"]
    calls = [c for t in turns for c in t.get("tool_calls", [])]
    assert calls, "the taught researcher called its tool"
    right = [c for c in calls if c["arguments"] == {"expression": "6*7"}]
    assert right and all(c["result"] == "42" and not c["error"] for c in right)
    assert all(len(t.get("tool_calls", [])) <= 1 for t in turns)  # max_tool_calls_per_turn
    for t in turns:
        assert t["generations"] == 1 + len(t.get("tool_calls", []))
    buyer = [t for ep in run["episodes"] for t in ep["turns"] if t["role"] == "buyer"]
    assert buyer and not any(t.get("tool_calls") for t in buyer)


def test_tool_results_are_context_in_the_trained_samples(run: dict) -> None:
    tok = run["tokenizer"]
    result = tok.encode("<|tool|>42<|end|>", add_special_tokens=False)
    with_result = 0
    for sample in (s for b in run["batches"]["A"] for s in b.samples):
        spans = sum(1 for i, m in enumerate(sample.loss_mask) if m and (i == 0 or not sample.loss_mask[i - 1]))
        at = [i for i in range(len(sample.tokens)) if sample.tokens[i:i + len(result)] == result]
        if at:
            with_result += 1
            assert spans == 2 and len(sample.weight_versions) == 2  # a generation before and after the result
            assert all(sample.loss_mask[i] == 0 for s in at for i in range(s, s + len(result)))
    assert with_result > 0
    for sample in (s for b in run["batches"]["B"] for s in b.samples):
        assert sum(1 for i, m in enumerate(sample.loss_mask) if m and not sample.loss_mask[i - 1]) == 1
