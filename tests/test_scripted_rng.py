"""``environment.scripted_rng`` (docs/architecture.md §4, "Opponent mix"): with ``group``, the G
copies of a training group give their scripted players one random stream, restarted from the group's seed in
every copy, so copies in which the agent plays alike get the same replies; with ``episode`` (the default) each
copy draws its own.

The coordinator (real, on the real Redis, through its own reply consumer) plays one group of six episodes, agent A
(the warm-started demo model, greedy, its replies generated in-process by this test as the rollout would) against the
env's ``random`` player: with ``group`` all six games are the same game; with ``episode`` they are not.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.contracts.config import parse_config
from services.contracts.messages import GenerateRequest
from services.contracts.players import AgentPlayer, Local, Scripted
from services.coordinator.scheduler import Coordinator
from services.play.local import LocalPlayers


async def play_one_group(redis_url: str, model_dir: Path, tmp_path: Path, scripted_rng: str) -> list[list[object]]:
    name = f"rng-{scripted_rng}"
    cfg = parse_config({"run": {"name": name, "output_dir": str(tmp_path / "runs")}, "redis_url": redis_url,
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}, "group_size": 6,
                                        "scripted_rng": scripted_rng},
                        "agents": {a: {"model_path": str(model_dir),
                                       "sampling": {"max_new_tokens": 4, "temperature": 0.0}} for a in "AB"}})
    bus, engine_bus = Bus(redis_url, name, "coordinator"), Bus(redis_url, name, "rollout-A")
    coord = Coordinator(cfg, bus)
    local, model, stop = LocalPlayers(), Local(path=str(model_dir), agent="A"), asyncio.Event()

    async def engine(req: GenerateRequest) -> None:
        reply = (await local.generate(model, req)).model_copy(update={"weight_version": 0})
        await engine_bus.publish(req.reply_stream, reply)

    tasks = [asyncio.create_task(bus.consume(bus.streams.replies(coord.name), "coordinator", coord.name,
                                             coord.on_reply, stop, count=64)),
             asyncio.create_task(engine_bus.consume(bus.streams.turns("A"), "rollout", "rollout-A", engine, stop,
                                                    concurrency=6))]
    try:
        roles = {"X": AgentPlayer(agent="A"), "O": Scripted(name="random")}
        done = await asyncio.wait_for(coord.play_group(3, roles, "g3"), 120)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        local.close()
        await engine_bus.close()
        await bus.close()
    assert len(done) == 6
    return [[*r.summary["moves"], r.summary["illegal_reply"]] for r in done]  # a game ends on an illegal reply


@pytest.mark.parametrize("scripted_rng", ["group", "episode"])
async def test_a_groups_copies_share_the_scripted_players_stream_only_with_group(
        scripted_rng: str, redis_url: str, warm_model_dir: Path, tmp_path: Path) -> None:
    games = await play_one_group(redis_url, warm_model_dir, tmp_path, scripted_rng)
    distinct = {tuple(g) for g in games}
    if scripted_rng == "group":
        assert len(distinct) == 1 and len(games[0]) >= 3, games  # a greedy agent and one stream: the same game six times
    else:
        assert len(distinct) > 1, games  # the same greedy agent against six streams
