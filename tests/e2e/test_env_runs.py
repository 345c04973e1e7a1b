"""Every environment config runs through ``tandem up`` on the demo model (slow; tiny overrides).

Each run is the real thing — embedded Redis, engines, router, rollout, buffers,
trainers, coordinator — with ``TANDEM__`` overrides that make it one training
step of small groups and a two-episode evaluation. The demo model is a byte-level
tic-tac-toe player, so outside tic-tac-toe its replies are junk: the point is
that the pipeline runs and that rewards and penalties reach the trainers.
Configs whose services are those of a run made here or in another end-to-end test (GRPO agents on the torch trainer
and the embedded engine), and differ only in their environment and its parameters, are played in process instead
(tests/integration/test_config_play.py): their training matchups and their evaluation, on in-process engines,
through the coordinator's own episode code.
Also: a plug-in environment from a test module runs by its ``module:Class`` path,
and bad environment parameters stop ``tandem up`` before anything starts.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.embedded_redis import free_port
from services.contracts.config import load_config
from services.envs.registry import check_environment_config
from services.launcher.preflight import extras_problems
from tests.helpers import run_up

REPO = Path(__file__).resolve().parents[2]


def _runs_on_cpu(path: Path) -> bool:
    """Configs for SGLang engines (configs/gpu.yaml) need GPUs; the deployment tests check those."""
    return all(a.get("engine", "embedded") == "embedded" for a in yaml.safe_load(path.read_text())["agents"].values())


# configs a deeper end-to-end test already runs through tandem up (the suite's time is spent once)
RUN_ELSEWHERE = {"support_desk": "tests/e2e/test_three_agents_e2e.py", "tool_relay": "tests/e2e/test_tools_e2e.py",
                 "pipeline_demo": "tests/e2e/test_pipeline.py",
                 # the sweep's set-ups: the demo, self-play and pool configs with one budget (those three run here)
                 "compare_cotrain": "demo", "compare_selfplay": "tictactoe_selfplay", "compare_pool": "tictactoe_pool",
                 "answer_demo": "answer_then_answer",  # the same environment and agents, other parameters
                 "llm_twenty_questions": "twenty_questions",  # its LoRA agents' path runs in llm_answer
                 "llm_tool_math": "tool_math",  # its pipeline's path: tests/e2e/test_pipeline.py, test_collect.py
                 "llm_tool_relay": "tests/e2e/test_tools_e2e.py",  # and its demonstrations: test_collect.py
                 "demo": "tests/unit/test_matchups.py", "shared_base": "tests/e2e/test_shared_base_run.py",
                 "compare_frozen": "tests/unit/test_sweep.py",  # its frozen set-up: a tic-tac-toe agent not trained
                 "guess_number": "guess_demo"}  # the same environment, other parameters
# configs played in process (test_config_plays_in_process): the services of runs made through tandem up here or in
# other end-to-end tests (one, two or three GRPO agents on the torch trainer and the embedded engine: test_e2e,
# test_three_agents_e2e; LoRA agents such as llm_answer's: test_shared_base_run, test_pipeline), another environment
IN_PROCESS = {"answer_then_answer", "code", "code_critic", "debate", "debate_agent_judge", "demo_long",
              "doctor_patient", "explore_exploit", "guess_demo", "llm_answer", "math", "math_critic", "math_dataset",
              "textarena_tictactoe", "tool_math", "twenty_questions"}
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml")
                 if _runs_on_cpu(p) and p.stem not in RUN_ELSEWHERE and p.stem not in IN_PROCESS)


def tandem_up(config: Path, tmp: Path, model: Path, extra: dict[str, str] | None = None,
              timeout: float = 420) -> tuple[subprocess.CompletedProcess, dict]:
    data = yaml.safe_load(config.read_text())
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TANDEM__run__total_steps": "1", "TANDEM__run__concurrent_episodes": "8",
           "TANDEM__run__output_dir": str(tmp / "runs"), "TANDEM__run__checkpoint_root": str(tmp / "ckpt"),
           "TANDEM__environment__group_size": "2", "TANDEM__environment__eval__episodes": "2",
           "TANDEM__api__port": str(free_port()), **(extra or {})}
    for agent in data["agents"]:
        env[f"TANDEM__agents__{agent}__model_path"] = str(model)
        env[f"TANDEM__agents__{agent}__groups_per_batch"] = "1"
    proc = run_up(config, env=env, timeout=timeout)
    summary_path = tmp / "runs" / data["run"]["name"] / "summary.json"
    return proc, (json.loads(summary_path.read_text()) if summary_path.exists() else {})


def check_run(proc: subprocess.CompletedProcess, summary: dict, trained: list[str]) -> None:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert summary["phase"] == "done" and summary["episodes"] > 0
    assert sorted(summary["agents"]) == sorted(trained)
    for name in trained:
        a = summary["agents"][name]
        assert a["weight_versions"] == 1 and a["steps"] == 1, a
        assert isinstance(a["reward_first_quarter"], float)  # rewards (and penalties) reached the samples
        assert isinstance(a["eval_start"], float) and isinstance(a["eval_end"], float)
    for ev in summary["evals"]:
        for name in trained:
            d = ev["details"][name]
            assert d["wins"] + d["draws"] + d["losses"] == d["episodes"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_config_runs_through_tandem_up(name: str, tmp_path: Path, warm_model_dir: Path) -> None:
    config = REPO / "configs" / f"{name}.yaml"
    data = yaml.safe_load(config.read_text())
    proc, summary = tandem_up(config, tmp_path, warm_model_dir)
    check_run(proc, summary, [a for a, c in data["agents"].items() if c.get("train", True)])


@pytest.mark.slow
def test_plugin_environment_from_a_test_module(tmp_path: Path, warm_model_dir: Path) -> None:
    cfg = {"run": {"name": "plugin"}, "environment": {
        "name": "plugin_env:CountUp", "params": {"target": 3}, "roles": {"left": "A", "right": "scripted:counter"},
        "eval": {"opponent": "counter"}},
        "agents": {"A": {"model_path": "unset", "sampling": {"max_new_tokens": 3}}}}
    path = tmp_path / "plugin.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc, summary = tandem_up(path, tmp_path, warm_model_dir)
    check_run(proc, summary, ["A"])


def test_the_configs_run_elsewhere_load_and_pass_the_checks_before_a_start() -> None:
    """What ``tandem up`` checks before it starts anything (schema, environment parameters, extras), for each
    config that another test runs in its place."""
    for name in sorted(RUN_ELSEWHERE):
        cfg = load_config(REPO / "configs" / f"{name}.yaml")
        check_environment_config(cfg.environment)
        assert extras_problems(cfg) == [], name


def test_bad_environment_parameters_fail_at_start_naming_the_parameter(tmp_path: Path, tiny_model_dir: Path) -> None:
    for name, params, named in [("guess_number", {"high": 0}, "high"), ("debate", {"rounds": "two"}, "rounds"),
                                ("textarena", {"game": "NoSuchGame-v0"}, "game")]:
        config = {"textarena": "textarena_tictactoe"}.get(name, name)
        data = yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())
        data["environment"]["params"] = params
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        proc, _ = tandem_up(path, tmp_path, tiny_model_dir, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"environment.params.{named}: {name}: {named}: " in proc.stderr, proc.stderr
        assert not (tmp_path / "runs").exists()  # nothing started
