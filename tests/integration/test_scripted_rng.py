"""``environment.scripted_rng`` (docs/architecture.md §4, "Opponent mix"): with ``group``, the G
copies of a training group give their scripted players one random stream, restarted in every copy from a seed
derived from the group's, so copies in which the agent plays alike get the same replies; with ``episode`` (the
default) each copy draws its own.

The coordinator (real, on the real Redis, through its own reply consumer) plays one group of six episodes, agent A
(the warm-started demo model, greedy, its replies generated in-process by this test as the rollout would) against the
env's ``random`` player: with ``group`` copies that reached one position by the same moves got the same reply from
``random``; with ``episode`` some did not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.bus import Bus
from services.contracts.config import parse_config
from services.contracts.messages import GenerateRequest
from services.contracts.players import AgentPlayer, Local, Scripted
from services.coordinator.scheduler import Coordinator
from services.play.local import LocalPlayers
from tests.helpers import play_group_over_bus


async def play_one_group(redis_url: str, model_dir: Path, tmp_path: Path, scripted_rng: str) -> list[list[object]]:
    name = f"rng-{scripted_rng}"
    cfg = parse_config({"run": {"name": name, "output_dir": str(tmp_path / "runs")}, "redis_url": redis_url,
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}, "group_size": 6,
                                        "scripted_rng": scripted_rng},
                        "agents": {a: {"model_path": str(model_dir),
                                       "sampling": {"max_new_tokens": 4, "temperature": 0.0}} for a in "AB"}})
    bus, engine_bus = Bus(redis_url, name, "coordinator"), Bus(redis_url, name, "rollout-A")
    coord = Coordinator(cfg, bus)
    local, model = LocalPlayers(), Local(path=str(model_dir), agent="A")

    async def engine(req: GenerateRequest) -> None:
        reply = (await local.generate(model, req)).model_copy(update={"weight_version": 0})
        await engine_bus.publish(req.reply_stream, reply)

    try:
        roles = {"X": AgentPlayer(agent="A"), "O": Scripted(name="random")}
        done = await play_group_over_bus(coord, engine_bus, engine, roles, 3, concurrency=6)
    finally:
        local.close()
        await engine_bus.close()
        await bus.close()
    assert len(done) == 6
    return [[*r.summary["moves"], r.summary["illegal_reply"]] for r in done]  # a game ends on an illegal reply


def scripted_agreement(games: list[list[object]]) -> list[bool]:
    """For each pair of games and each reply of the scripted player (O: odd moves) that both games reached
    by the same moves: whether the two replies are the same cell."""
    out = []
    for i, a in enumerate(games):
        for b in games[i + 1:]:
            for k in range(1, min(len(a), len(b)), 2):
                if a[:k] != b[:k]:
                    break
                out.append(a[k] == b[k])
    return out


@pytest.mark.parametrize("scripted_rng", ["group", "episode"])
async def test_a_groups_copies_share_the_scripted_players_stream_only_with_group(
        scripted_rng: str, redis_url: str, warm_model_dir: Path, tmp_path: Path) -> None:
    """The agent is greedy, but its engine batches the copies' turns as they come, so the test does not need
    six identical games: only that copies which reached the same position got the same scripted reply."""
    agreement = scripted_agreement(await play_one_group(redis_url, warm_model_dir, tmp_path, scripted_rng))
    assert agreement  # the copies reached a scripted reply by the same moves at least once
    if scripted_rng == "group":
        assert all(agreement), agreement  # one stream: the same position, the same reply
    else:
        assert not all(agreement), agreement  # six streams (random among 8 cells): some differ
