"""Which staleness gate holds the next group back (services/coordinator/state.py, docs/architecture.md §4).

The demo's layout: A on-policy (max_staleness 0) and B one version ahead (1), every group played by
both. Once A's gate closes the next group waits on A alone; the status names A's gate, and when the
group launches both agents count it as held back by A.
"""

from __future__ import annotations

from services.contracts.config import load_config
from services.coordinator.state import RunState
from tests.helpers import REPO


def test_the_status_names_the_gate_that_holds_the_next_group() -> None:
    state = RunState.from_config(load_config(REPO / "configs" / "demo.yaml"))
    a, b = state.agents["A"], state.agents["B"]
    per_batch = a.groups_per_batch
    for index in range(per_batch):  # step 1's groups: both gates open
        assert state.closed_gates(index, [a, b]) == []
        a.in_flight_groups += 1
        b.in_flight_groups += 1
        state.launched(index)
    assert state.status()["waiting_group"] is None
    assert state.closed_gates(per_batch, [a, b]) == ["A"]  # A waits for version 1; B may run one ahead
    status = state.status()
    assert status["waiting_group"]["held_by"] == ["A"] and status["waiting_group"]["agents"] == ["A", "B"]
    assert status["agents"]["A"]["gate"]["holding_next_group"] and status["agents"]["A"]["gate"]["open"] is False
    assert status["agents"]["B"]["gate"] == {"open": True, "holding_next_group": False, "groups_held": 0,
                                             "held_s": 0.0, "held_back_by": {}}
    a.loaded_weight_version = 1  # A's version 1 is loaded: its gate opens
    assert state.closed_gates(per_batch, [a, b]) == []
    state.launched(per_batch)
    status = state.status()
    assert status["waiting_group"] is None and state.groups_launched == per_batch + 1
    assert status["agents"]["A"]["gate"]["groups_held"] == 1 and status["agents"]["B"]["gate"]["groups_held"] == 0
    assert status["agents"]["A"]["gate"]["held_back_by"] == {"A": 1}
    assert status["agents"]["B"]["gate"]["held_back_by"] == {"A": 1}
