"""TensorBoard's scalars share one step axis: the agent's training step (its weight version).

The RunLogger follows a run state through several writes, as it does beside the coordinator; then
TensorBoard's own reader checks that every scalar's steps lie on the training steps, that groups and
pipeline samples sit at the version trained when they happened, and that no tag repeats another.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.contracts.config import parse_config
from services.coordinator.state import RunState
from services.coordinator.tracking import RunLogger, trained_version_at


def _cfg(tmp_path: Path) -> dict:
    agent = {"model_path": "m", "sampling": {"max_new_tokens": 4}}
    return {"run": {"name": "tb", "output_dir": str(tmp_path / "runs"), "checkpoint_root": str(tmp_path / "ck")},
            "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"},
                            "eval": {"opponents": ["random", "minimax"]}},
            "agents": {"A": agent, "B": agent}, "logging": {"text_every": 0}}


def _report(score: float) -> dict:
    return {"score": score, "score_se": 0.05, "wins": 3, "draws": 1, "losses": 0, "illegal_rate": 0.0,
            "mean_reward": score}


def _eval(label: str, version: int) -> dict:
    vs = {a: {"random": _report(0.5 + version / 10), "minimax": _report(version / 10)} for a in ("A", "B")}
    return {"label": label, "time": time.time(), "versions": {"A": version, "B": version},
            "scores": {a: r["random"]["score"] for a, r in vs.items()},
            "details": {a: r["random"] for a, r in vs.items()}, "vs": vs}


def test_versions_at_a_time() -> None:
    steps = [{"weight_version": 1, "time": 10.0}, {"weight_version": 2, "time": 20.0}]
    assert [trained_version_at(steps, t) for t in (5, 10, 15, 25)] == [0, 1, 1, 2]
    assert trained_version_at([{"weight_version": 3, "time": None}], 0) == 3  # rebuilt after a restart


async def test_scalars_share_the_training_step_axis(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = parse_config(_cfg(tmp_path))
    state = RunState.from_config(cfg)
    coord = SimpleNamespace(state=state, evals=[_eval("start", 0)], episodes={})
    logger = RunLogger(cfg)
    t0 = time.time() - 100
    for v in (1, 2, 3):  # a step: two groups finish, then the version is trained; the logger writes between
        for a in state.agents.values():
            a.group_rewards += [(t0 + 10 * v, 0.1 * v), (t0 + 10 * v + 1, -0.1 * v)]
            a.train_steps.append({"weight_version": v, "pg_loss": 0.1 * v, "lr": 1e-3, "time": t0 + 10 * v + 5})
            a.loaded_weight_version = v
        if v == 2:
            coord.evals.append(_eval("step-2", 2))
        logger.write(logger.collect(coord))
    coord.evals.append(_eval("end", 3))
    await logger.close(coord)

    acc = EventAccumulator(str(cfg.run_dir() / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert len(tags) == len(set(tags))
    for agent in ("A", "B"):
        mine = [t for t in tags if t.startswith(f"{agent}/")]
        assert {t.split("/")[1] for t in mine} == {"train", "reward", "pipeline", "eval_random", "eval_minimax"}
        for tag in mine:  # one axis: every step is a training step of this run (0 = the start model)
            assert {e.step for e in acc.Scalars(tag)} <= {0, 1, 2, 3}, tag
        assert [e.step for e in acc.Scalars(f"{agent}/train/pg_loss")] == [1, 2, 3]
        assert [(e.step, e.value) for e in acc.Scalars(f"{agent}/eval_minimax/score")] == [
            (0, 0.0), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
        # the groups of each step finished before its version was trained: at the version before it
        assert [(e.step, e.value) for e in acc.Scalars(f"{agent}/reward/groups")] == [(0, 2), (1, 2), (2, 2)]
        assert [e.value for e in acc.Scalars(f"{agent}/reward/group_max")] == pytest.approx([0.1, 0.2, 0.3])
        pipeline = acc.Scalars(f"{agent}/pipeline/weight_version")
        assert [e.step for e in pipeline] == [1, 2, 3, 3]  # three follows and the final write
        assert all(e.wall_time > t0 for e in pipeline)
        assert not any(t.startswith(f"{agent}/eval/") for t in tags)  # the headline is eval_random's
