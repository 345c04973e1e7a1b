"""The pure helpers of the real-model system bench: a system step's phases from ``metrics.json``, and the groups
the in-process loop plays a step (tests/bench/bench_llm_system.py, tests/bench/inprocess_loop.py)."""

from __future__ import annotations

from services.contracts.config import load_config
from services.contracts.records import TrainLogRecord
from services.coordinator.state import train_step_entry
from tests.bench.bench_llm_system import batch_ends, phases
from tests.bench.inprocess_loop import step_groups


def agent_metrics(groups: list[float], steps: list[tuple[float, float]]) -> dict:
    """An agent's ``metrics.json`` entry, its train steps as the coordinator keeps them (services/coordinator/events.py:
    the committed record's entry and the event's time)."""
    return {"group_rewards": [[t, 0.5] for t in groups],
            "train_steps": [{**train_step_entry(TrainLogRecord(weight_version=v, metrics={"train_seconds": s})),
                             "time": t} for v, (t, s) in enumerate(steps, 1)]}


def test_batch_ends_take_every_batch_last_group() -> None:
    assert batch_ends([[3.0, 0], [1.0, 0], [2.0, 0], [4.0, 0], [5.0, 0]], 2) == [2.0, 4.0]


def test_phases_split_each_step_after_the_first_at_its_last_group() -> None:
    # two groups a batch; A's batches end at 2, 12, 22 and train until 5, 15, 25; B ends later each time
    metrics = {"A": agent_metrics([1, 2, 11, 12, 21, 22], [(5, 2.0), (15, 2.5), (25, 3.0)]),
               "B": agent_metrics([1, 3, 11, 13, 21, 24], [(6, 1.0), (16, 4.0), (27, 1.0)])}
    assert phases(metrics, 2) == [{"play_s": 13 - 6, "train_s": 16 - 13, "trainer_s": 4.0},
                                  {"play_s": 24 - 16, "train_s": 27 - 24, "trainer_s": 3.0}]


def test_step_groups_give_each_agent_its_groups_per_batch() -> None:
    cfg = load_config("configs/llm_answer.yaml")  # A and B in every group, 8 groups a batch each
    assert step_groups(cfg, 0) == list(range(8))
    assert step_groups(cfg, 8) == list(range(8, 16))
