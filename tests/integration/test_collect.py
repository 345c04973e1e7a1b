"""``tandem collect``: trajectories as chat-format JSONL, read by the Tinker cookbook's conversation loader;
demonstrations, and the shipped pipelines' demonstrations on the real model's tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.play.collect import weight_version
from tests.helpers import REPO

COOKBOOK = Path(os.environ.get("TANDEM_COOKBOOK_VENV", REPO / "build" / "cookbook-venv")) / "bin" / "python"
LOADER = """
import sys
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=sys.argv[2], renderer_name="role_colon",
                                        max_length=4096, batch_size=2)
train, test = FromConversationFileBuilder(file_path=sys.argv[1], common_config=common)()
batch = train.get_batch(0)
print(len(train), len(batch), sum(len(d.model_input.to_ints()) for d in batch))
"""


def collect(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", "collect", str(config), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def relay_config(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("collect")
    cfg = yaml.safe_load((REPO / "configs" / "tool_relay.yaml").read_text())
    cfg["environment"]["params"]["system"] = {"researcher": "", "buyer": ""}
    cfg["environment"]["params"]["tools"] = {"researcher": ["calculator"]}
    for agent in cfg["agents"].values():
        agent["model_path"] = str(tiny_model_dir)
        agent["sampling"]["max_new_tokens"] = 8
    path = d / "tool_relay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_collect_writes_chat_records_with_rewards_and_versions(relay_config: Path, tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    ckpt = tmp_path / "v00003"
    ckpt.symlink_to(tiny_model_dir, target_is_directory=True)
    out = tmp_path / "traj.jsonl"
    proc = collect(relay_config, "--checkpoint", f"A={ckpt}", "--episodes", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and "8 trajectories written" in proc.stdout  # 4 episodes x 2 model roles
    assert "0 below --min-reward, 0 roles with no turn" in proc.stdout  # the buyer always gets the report
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles[0] == ("system" if row["role"] == "researcher" else "user") and roles[-1] == "assistant"
        assert set(roles) <= {"system", "user", "assistant", "tool"}
        assert isinstance(row["reward"], float) and {"right", "report_right"} <= set(row["measures"])
        assert row["weight_version"] == (3 if row["agent"] == "A" else 0)
    kept = tmp_path / "kept.jsonl"
    proc = collect(relay_config, "--episodes", "4", "--out", str(kept), "--min-reward", "0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(json.loads(line)["reward"] >= 0.5 for line in kept.read_text().splitlines())
    if not COOKBOOK.exists():
        pytest.skip(f"no Tinker cookbook virtualenv at {COOKBOOK} (`make cookbook-venv`)")
    loaded = subprocess.run([str(COOKBOOK), "-c", LOADER, str(out), str(tiny_model_dir)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    n, batch, tokens = map(int, loaded.stdout.split()[-3:])
    assert n == 4 and batch == 2 and tokens > 0  # 8 conversations in batches of 2, rendered to tokens


def test_bad_collect_arguments_fail_with_a_reason(relay_config: Path, tmp_path: Path) -> None:
    proc = collect(relay_config, "--checkpoint", f"Z={tmp_path}", "--episodes", "1", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "no agent 'Z'" in proc.stderr
    proc = collect(relay_config, "--episodes", "0", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--episodes 0" in proc.stderr
    assert weight_version("/x/v00012") == 12 and weight_version("/models/smollm2") == 0


def test_demonstrations_call_the_tools_and_are_right(relay_config: Path, tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    """``--demonstrate``: the environment writes the roles' turns (search, calculator, then the report; the right
    decision) in each agent's chat template; the tools really run, and every episode earns the full reward. A
    demonstration longer than the agent's max_new_tokens is refused, naming the field."""
    model = tmp_path / "model"  # the tiny model with room for two tools' signatures in its byte-level context
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    cfg = yaml.safe_load(relay_config.read_text())
    cfg["environment"]["params"]["tools"] = {"researcher": ["search", "calculator"]}
    for agent in cfg["agents"].values():
        agent["model_path"] = str(model)
    short = tmp_path / "short.yaml"  # 8 new tokens: too few for a search call
    short.write_text(yaml.safe_dump(cfg))
    proc = collect(short, "--episodes", "1", "--out", str(tmp_path / "x"), "--demonstrate", "researcher")
    assert proc.returncode == 2 and ("the demonstration of role 'researcher' takes" in proc.stderr
                                     and "more than agents.A.sampling.max_new_tokens (8)" in proc.stderr)
    cfg["agents"]["A"]["sampling"]["max_new_tokens"] = 128
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "demo.jsonl"
    proc = collect(config, "--episodes", "3", "--out", str(out), "--demonstrate", "researcher",
                   "--demonstrate", "buyer")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(row["demonstration"] for row in rows)
    for row in (r for r in rows if r["role"] == "researcher"):
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"], roles
        search, found, multiply, total, report = (m["content"] for m in row["messages"][2:])
        assert search.startswith('<tool_call>{"name": "search"') and multiply.startswith(
            '<tool_call>{"name": "calculator"')
        assert not found.startswith("error") and report.endswith(total.strip())  # the report ends in the result
        assert row["reward"] == 1.5 and row["measures"]["report_right"] == 1.0 and row["measures"]["right"] == 1.0
    assert all(r["reward"] == 1.0 for r in rows if r["role"] == "buyer")
    proc = collect(config, "--episodes", "1", "--out", str(tmp_path / "x"), "--demonstrate", "judge")
    assert proc.returncode == 2 and "--demonstrate judge: not a role an agent plays here" in proc.stderr


PIPELINES = sorted(p.stem for p in (REPO / "configs").glob("*.yaml")
                   if (yaml.safe_load(p.read_text()).get("pipeline") or {}).get("demonstrate"))


@pytest.mark.parametrize("name", PIPELINES)
def test_the_shipped_pipelines_demonstrations_fit_their_agents(name: str, real_model_dir: Path,
                                                               tmp_path: Path) -> None:
    """Each shipped config with ``pipeline.demonstrate`` collects its demonstrations as ``tandem pipeline`` does,
    for three run seeds, on the real model's tokenizer: every one kept (right), none longer than its agent's
    ``sampling.max_new_tokens`` (the collect stage refuses those)."""
    assert PIPELINES, "no shipped config demonstrates"
    cfg = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    for agent in cfg["agents"].values():
        agent["model_path"] = str(real_model_dir)
    pipe = cfg["pipeline"]
    for seed in range(3):
        cfg["run"]["seed"] = seed
        path, out = tmp_path / f"{name}-{seed}.yaml", tmp_path / f"{name}-{seed}.jsonl"
        path.write_text(yaml.safe_dump(cfg))
        proc = collect(path, "--episodes", str(pipe["episodes"]), "--out", str(out), "--min-reward",
                       str(pipe["min_reward"]), *[f"--demonstrate={role}" for role in pipe["demonstrate"]])
        assert proc.returncode == 0, (seed, proc.stderr[-2000:])
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(rows) == pipe["episodes"] * len(pipe["demonstrate"]) and all(r["demonstration"] for r in rows)
