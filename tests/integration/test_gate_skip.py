"""Launches past a held group (services/coordinator/scheduler.py ``next_group``, docs/architecture.md §4).

The demo's layout: groups alternate A's matchups (even indices) and B's (odd); A on-policy (its gate closes
after 8 groups at version 0), B one version ahead (16). The real coordinator's loop, on a real Redis, its groups
not played: once A's gate holds group 16, B's groups behind it launch (17, 19, ... 31) and group 16 waits;
the launched indices (every one below 16, and those ahead of it) are in Redis, so a restarted coordinator
launches group 16 and A's next ones, then B's past 31, and never an index twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from services.common.bus import Bus
from services.contracts.config import load_config
from services.coordinator.scheduler import Coordinator
from tests.helpers import REPO


def coordinator(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> Coordinator:
    cfg = load_config(REPO / "configs" / "demo.yaml")
    cfg = cfg.model_copy(update={"redis_url": redis_url})
    cfg.run.output_dir, cfg.run.checkpoint_root = str(tmp_path / "runs"), str(tmp_path / "ckpt")
    for agent in cfg.agents.values():
        agent.model_path = str(tiny_model_dir)
    coord = Coordinator(cfg, Bus(redis_url, "gate-skip", "coordinator"))

    async def unplayed(*_: object) -> None:  # launched, in flight, never played
        return None

    coord.groups.run_group = unplayed  # type: ignore[method-assign]
    return coord


async def settle(coord: Coordinator) -> None:
    """Run the loop until it launches nothing more."""
    loop = asyncio.create_task(coord.training_loop())
    try:
        before = -1
        while before != (now := coord.state.groups_launched + len(coord.state.launched_ahead)):
            before = now
            await coord.events.notify()
            await asyncio.sleep(0.3)
        assert not loop.done()
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


async def indices(coord: Coordinator) -> dict[str, list[int]]:
    """Agent -> the group indices in its ledger, each group once."""
    out = {}
    for agent in ("A", "B"):
        gids = await coord.groups.ledger.outcomes(agent)
        out[agent] = sorted(int(g[1:7]) for g in gids)
    return out


async def test_a_held_agent_s_group_does_not_stop_the_other_agent_s(redis_url: str, tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    coord = coordinator(redis_url, tiny_model_dir, tmp_path)
    await coord.restore()
    await settle(coord)
    st = coord.state
    a_first, b_all = list(range(0, 16, 2)), list(range(1, 32, 2))
    assert await indices(coord) == {"A": a_first, "B": b_all}
    assert st.groups_launched == 16 and st.launched_ahead == set(range(17, 32, 2))
    assert st.gate_wait is not None and st.gate_wait.index == 16 and st.gate_wait.held_by == {"A"}
    ledger = coord.groups.ledger
    assert await ledger.groups_launched() == 16 and await ledger.launched_ahead() == set(range(17, 32, 2))
    assert coord.next_group() is None  # B's gate is closed too (16 groups at version 0): nothing to launch

    st.agents["A"].loaded_weight_version = 1  # A's gate opens: group 16 launches, then A's next ones
    await settle(coord)
    a_two = list(range(0, 32, 2))
    assert await indices(coord) == {"A": a_two, "B": b_all}
    assert st.groups_launched == 32 and st.launched_ahead == set() and st.gate_wait.index == 32
    assert st.status()["agents"]["A"]["gate"]["groups_held"] == 1
    await coord.bus.close()


async def test_a_restart_launches_the_skipped_group_once(redis_url: str, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    first = coordinator(redis_url, tiny_model_dir, tmp_path)
    await first.restore()
    await settle(first)  # A's group 16 held, B's 17 ... 31 launched: then the coordinator dies
    await first.bus.close()
    again = coordinator(redis_url, tiny_model_dir, tmp_path)
    await again.restore()  # the groups that were playing are abandoned: both gates open again
    assert again.state.groups_launched == 16 and again.state.launched_ahead == set(range(17, 32, 2))
    await settle(again)
    got = await indices(again)
    assert got["A"] == list(range(0, 16, 2)) + list(range(16, 32, 2))  # group 16 and A's next, once each
    assert got["B"] == list(range(1, 32, 2)) + list(range(33, 64, 2))  # B's past 31, none again
    assert again.state.groups_launched == 32 and again.state.launched_ahead == set(range(33, 64, 2))
    await again.bus.close()
