"""``GET /v1/status``'s contract (services/contracts/status.py): the run state's status validates as a
``RunStatus`` and comes back key for key, values unchanged; a key added later, and an evaluation report of an
older run without the keys added since, still validate."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.contracts.config import load_config
from services.contracts.status import RunStatus
from services.coordinator.state import RunState
from tests.helpers import REPO


def _status() -> dict:
    state = RunState.from_config(load_config(REPO / "configs" / "demo.yaml"))
    a = state.agents["A"]
    a.train_steps.append({"reward_mean": 0.25, "weight_version": 1, "zero_variance_groups": 0.5, "time": 1.0})
    a.group_rewards.append((1.0, 0.5))
    a.rollout = {"queue_depth": 2, "engines": [{"url": "http://e0", "healthy": True, "restarts": 1}]}
    a.in_flight_groups = 100  # A's gate closes: the next group waits on it
    assert state.closed_gates(0, [a]) == ["A"]
    old = {"label": "start", "time": 1.0, "versions": {"A": 0}, "scores": {"A": 0.5}, "details": {}, "vs": {}}
    new = {"label": "end", "time": 2.0, "versions": {"A": 1}, "checkpoints": {"A": None}, "opponents": ["minimax"],
           "frozen": [], "scores": {"A": None}, "details": {"A": {"score": None}}, "vs": {"A": {"minimax": {}}}}
    return {**state.status(), "evals": [old, new], "rejected_replies": {"A": {"replies": 1, "episodes_abandoned": 0}},
            "redis": "ok", "added_later": {"x": 1}}


def test_the_status_round_trips_through_its_contract() -> None:
    status = _status()
    parsed = RunStatus.model_validate(status)
    assert parsed.phase == "starting" and parsed.agents["A"].gate.holding_next_group
    assert parsed.waiting_group is not None and parsed.waiting_group.held_by == ["A"]
    again = parsed.model_dump(mode="json", exclude_unset=True)
    assert json.dumps(again, sort_keys=True) == json.dumps(status, sort_keys=True)


def test_a_status_without_a_declared_key_is_refused() -> None:
    status = _status()
    del status["agents"]["A"]["gate"]
    with pytest.raises(ValidationError, match="gate"):
        RunStatus.model_validate(status)
