"""A run that learns nothing says so: each step's share of zero-variance groups and malformed samples, a warning
at the first step without signal, and a stop (an error, a non-zero exit) after ``max_no_signal_steps`` in a row."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from services.common.embedded_redis import free_port
from services.contracts.config import parse_config
from services.contracts.messages import Sample
from services.coordinator.learning_signal import SignalWatch, no_signal_streak, signal_status
from services.launcher.live_view import status_table
from services.training.signal import learning_signal
from tests.helpers import run_up


def sample(group: str, reward: float, malformed: int = 0) -> Sample:
    return Sample(agent="A", role="r", episode_id=f"{group}-{reward}-{malformed}", group_id=group, group_samples=2,
                  tokens=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, -0.5], reward=reward, weight_versions=[0],
                  malformed_turns=malformed)


def test_batch_signal_counts_flat_groups_and_malformed_samples() -> None:
    batch = [sample("g1", 0.5), sample("g1", 0.5, 1), sample("g2", 0.0, 2), sample("g2", 1.0)]
    assert learning_signal(batch) == {"zero_variance_groups": 0.5, "malformed_rate": 0.5}
    assert learning_signal([sample("g", -0.2, 1), sample("g", -0.2, 1)]) == {
        "zero_variance_groups": 1.0, "malformed_rate": 1.0}
    assert learning_signal([]) == {}


def cfg(limit: int) -> object:
    return parse_config({"run": {"name": "t"}, "environment": {"name": "guess_number", "roles": {"guesser": "A"}},
                         "agents": {"A": {"model_path": "m", "max_no_signal_steps": limit}}})


def test_the_first_step_without_signal_is_warned_of_and_the_limit_stops_the_run(
        caplog: pytest.LogCaptureFixture) -> None:
    agent = SimpleNamespace(train_steps=[])
    state = SimpleNamespace(agents={"A": agent}, error=None, stop_requested=False)
    watch = SignalWatch(cfg(3))  # type: ignore[arg-type]

    def step(v: int, zero: float) -> None:
        agent.train_steps.append({"weight_version": v, "zero_variance_groups": zero, "malformed_rate": 1.0})
        watch.check(state, "A")  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, "tandem.coordinator"):
        step(1, 1.0)
        step(2, 1.0)
        step(3, 0.5)  # a step with signal ends the streak
        step(4, 1.0)
        step(5, 1.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "step 1 had no learning signal" in warnings[0] and "100% of its samples" in \
        warnings[0] and "step 4" in warnings[1]
    assert not state.stop_requested and no_signal_streak(agent.train_steps) == 2
    step(6, 1.0)
    assert state.stop_requested and "agent A had no learning signal in 3 training steps in a row" in state.error
    assert "agents.A.max_no_signal_steps=3" in state.error
    assert signal_status(agent.train_steps) == {"zero_variance_groups": 1.0, "malformed_rate": 1.0,
                                                "no_signal_steps": 3}
    live = {"run": "r", "phase": "training", "total_steps": 6, "episodes_per_s": 0.0, "agents": {"A": {
        "step": 6, "weight_version": 6, "recent_group_reward": None, "signal": signal_status(agent.train_steps)}}}
    table = status_table(live)  # the live view: malformed and zero-var 1.00, the streak in red under the table
    assert [c._cells[0] for c in table.columns if c.header in ("malformed", "zero-var")] == ["1.00", "1.00"]
    assert "[red]A: no learning signal in 3 steps in a row[/red]" in str(table.caption)
    assert signal_status([]) == {"zero_variance_groups": None, "malformed_rate": None, "no_signal_steps": 0}
    never = SimpleNamespace(agents={"A": agent}, error=None, stop_requested=False)
    SignalWatch(cfg(0)).check(never, "A")  # type: ignore[arg-type]  # 0: never stop
    assert not never.stop_requested


@pytest.mark.slow
def test_a_run_whose_replies_never_parse_stops_with_the_message(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The whole run on the tiny model: a guess_number range the model's replies can never fall in (every reply
    malformed, every group's rewards equal), two steps without signal allowed: ``tandem up`` stops, non-zero,
    saying why; summary.json and the per-step signal say it too."""
    config = {"run": {"name": "nosignal", "total_steps": 6, "concurrent_episodes": 8,
                      "output_dir": str(tmp_path / "runs"), "checkpoint_root": str(tmp_path / "ckpt")},
              "redis_url": "", "api": {"host": "127.0.0.1", "port": free_port()},
              "environment": {"name": "guess_number", "group_size": 2, "roles": {"guesser": "A"},
                              "params": {"low": 1000, "high": 1001, "max_turns": 1, "system": {"guesser": ""}},
                              "eval": {"episodes": 0}},
              "agents": {"A": {"model_path": str(tiny_model_dir), "groups_per_batch": 1, "max_no_signal_steps": 2,
                               "sampling": {"temperature": 1.0, "max_new_tokens": 2}}}}
    path = tmp_path / "nosignal.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_up(path, env={**os.environ}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "had no learning signal in 2 training steps in a row" in out, out[-3000:]
    summary = json.loads((tmp_path / "runs" / "nosignal" / "summary.json").read_text())
    assert "no learning signal" in summary["error"] and summary["phase"] == "stopped"
    steps = summary["agents"]["A"]["signal_per_step"]
    assert len(steps) >= 2 and all(s["zero_variance_groups"] == 1.0 and s["malformed_rate"] == 1.0 for s in steps)
