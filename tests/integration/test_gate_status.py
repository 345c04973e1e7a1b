"""Which staleness gate holds the next group back (services/coordinator/state.py, docs/architecture.md §4).

The demo's layout: A on-policy (max_staleness 0) and B one version ahead (1), every group played by
both. Once A's gate closes the next group waits on A alone; the status names A's gate, and when the
group launches both agents count it as held back by A. The coordinator's ``/metrics`` carries the same.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from services.common.bus import Bus
from services.contracts.config import load_config
from services.coordinator.api import create_app
from services.coordinator.scheduler import Coordinator
from services.coordinator.state import RunState
from tests.helpers import REPO
from tests.integration.test_metrics import samples, serving


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


async def test_the_gates_are_in_the_coordinators_metrics(redis_url: str, tiny_model_dir: Path) -> None:
    """The same layout through the real coordinator's ``GET /metrics``: while A's gate holds the next group,
    ``tandem_gate_holding`` names A and the wait grows; once it launches, both agents count it held by A."""
    cfg = load_config(REPO / "configs" / "demo.yaml").model_copy(update={"redis_url": redis_url})
    for agent in cfg.agents.values():
        agent.model_path = str(tiny_model_dir)
    bus = Bus(redis_url, "gate-metrics", "coordinator")
    coord = Coordinator(cfg, bus)
    state = coord.state
    a, b = state.agents["A"], state.agents["B"]
    for index in range(a.groups_per_batch):
        assert state.closed_gates(index, [a, b]) == []
        a.in_flight_groups += 1
        b.in_flight_groups += 1
        state.launched(index)
    assert state.closed_gates(a.groups_per_batch, [a, b]) == ["A"]
    state.gate_wait.since -= 2.0  # type: ignore[union-attr]  (the group has waited 2 s)
    async with serving(create_app(coord)) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        held = samples((await client.get("/metrics")).text)
        a.loaded_weight_version = 1  # A's version 1 is loaded: its gate opens and the group launches
        assert state.closed_gates(a.groups_per_batch, [a, b]) == []
        state.launched(a.groups_per_batch)
        after = samples((await client.get("/metrics")).text)
    await bus.close()
    ga, gb = (("agent", "A"),), (("agent", "B"),)
    assert held[("tandem_gate_holding", ga)] == 1 and held[("tandem_gate_holding", gb)] == 0
    assert held[("tandem_gate_wait_seconds", ())] >= 2.0
    assert held[("tandem_gate_held_seconds_total", ga)] >= 2.0 and held[("tandem_gate_held_seconds_total", gb)] == 0
    assert held[("tandem_gate_held_groups_total", ga)] == 0  # counted at the launch
    assert after[("tandem_gate_holding", ga)] == 0 and after[("tandem_gate_wait_seconds", ())] == 0
    assert after[("tandem_gate_held_groups_total", ga)] == 1 and after[("tandem_gate_held_groups_total", gb)] == 0
    assert after[("tandem_gate_held_seconds_total", ga)] >= held[("tandem_gate_held_seconds_total", ga)]
    for agent in ("A", "B"):  # A's gate held back one group of each
        assert after[("tandem_gate_held_back_groups_total", (("agent", agent), ("gate", "A")))] == 1
    assert not any(k[0] == "tandem_gate_held_back_groups_total" and ("gate", "B") in k[1] for k in after)
