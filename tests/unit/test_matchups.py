"""A per-group opponent mix (``environment.matchups``) and failed episodes, in the coordinator.

Config checks name the field; the schedule is a pure function of the group index (a restart derives the
same matchup); and the coordinator, on a real Redis with real tiny models generating every turn (an
in-process engine answers the turns stream in place of a rollout), launches each matchup's groups only
for the agents in it: the ledger, the emitted samples and the buffer's membership agree per agent, an
agent absent from a group has no entry for it, and a matchup nobody in it still needs is passed over.
An episode whose turn fails is counted (``episodes_failed``, kept in Redis) and its group is emitted
with the rest, a smaller group the buffer accepts as the ledger records it.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from services.buffer.store import SampleStore
from services.common.bus import Bus
from services.contracts.codec import FIELD, decode
from services.contracts.config import ConfigError, TandemConfig, parse_config
from services.contracts.messages import GenerateRequest, Sample
from services.contracts.players import AgentPlayer, Scripted
from services.coordinator.scheduler import Coordinator
from services.envs.registry import check_environment_config
from services.inference.generator import Engine
from services.play.local import EnginePlayers, generate_on

MIX = [{"X": "A", "O": "B"}, {"X": "A", "O": "scripted:minimax"}, {"X": "scripted:random", "O": "B"}]


def config(matchups: list, agents: dict | None = None, **extra) -> dict:
    agents = agents or {"A": {"model_path": "m"}, "B": {"model_path": "m"}}
    env = {"name": "tictactoe", "roles": {"X": "A", "O": "B"}, "alternate_roles": True, "matchups": matchups,
           **extra}
    return {"run": {"name": "mx"}, "environment": env, "agents": agents}


@pytest.mark.parametrize(("matchups", "agents", "message"), [
    ([{"X": "A", "O": "B"}, {"X": "A", "O": "C"}], None, "environment.matchups[1].O names agent 'C'"),
    ([{"X": "A", "O": "pool:C"}], None, "environment.matchups[0].O names agent 'C'"),
    ([{"X": "A"}], None, "environment.matchups[0]: names roles ['X'], not ['O', 'X']"),
    ([{"X": "A", "O": "B", "Z": "A"}], None, "environment.matchups[0]: names roles ['O', 'X', 'Z']"),
    ([{"X": "A", "O": "B"}, {"X": "scripted:random", "O": "scripted:minimax"}], None,
     "environment.matchups[1]: no role is played by an agent that trains"),
    ([{"X": "A", "O": "B"}, {"X": "B", "O": "scripted:random"}],
     {"A": {"model_path": "m"}, "B": {"model_path": "m", "train": False}},
     "environment.matchups[1]: no role is played by an agent that trains"),
    ([{"X": "A", "O": "bot:minimax"}], None, "environment.matchups[0].O: 'bot:minimax' is not an agent name"),
    ([{"X": "A", "O": "scripted:minimax"}], None, "agents.B: trains but plays no role under environment.matchups"),
    (["X=A"], None, "environment.matchups[0]: 'X=A' is not a role -> player map"),
])
def test_matchups_are_checked_at_load_naming_the_field(matchups: list, agents: dict | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(config(matchups, agents))


def test_a_matchup_scripted_player_is_checked_against_the_environment() -> None:
    cfg = parse_config(config([{"X": "A", "O": "B"}, {"X": "A", "O": "scripted:alphazero"}]))
    with pytest.raises(ValueError, match=r"environment.matchups\[1\].O: scripted player 'alphazero'"):
        check_environment_config(cfg.environment)
    check_environment_config(parse_config(config(MIX)).environment)  # minimax and random play either side


def test_the_schedule_cycles_matchups_and_alternates_seats_per_cycle() -> None:
    env = parse_config(config(MIX)).environment
    got = [{r: str(p) for r, p in env.group_roles(i).items()} for i in range(7)]
    assert got == [{"X": "A", "O": "B"}, {"X": "A", "O": "scripted:minimax"}, {"X": "scripted:random", "O": "B"},
                   {"X": "B", "O": "A"}, {"X": "scripted:minimax", "O": "A"}, {"X": "B", "O": "scripted:random"},
                   {"X": "A", "O": "B"}]
    again = parse_config(config(MIX)).environment  # a restarted coordinator: the same map for the same index
    assert [again.group_roles(i) for i in range(50)] == [env.group_roles(i) for i in range(50)]
    plain = parse_config(config([])).environment  # no matchups: roles, alternating, as before
    assert [plain.group_roles(i) for i in range(3)] == [
        {"X": AgentPlayer(agent="A"), "O": AgentPlayer(agent="B")},
        {"X": AgentPlayer(agent="B"), "O": AgentPlayer(agent="A")},
        {"X": AgentPlayer(agent="A"), "O": AgentPlayer(agent="B")}]
    assert env.group_roles(1)["O"] == Scripted(name="minimax")


def run_config(redis_url: str, model: str, out: Path) -> TandemConfig:
    agent = {"model_path": model, "max_staleness": 0, "sampling": {"max_new_tokens": 2}}
    cfg = config(MIX, {"A": {**agent, "groups_per_batch": 2}, "B": {**agent, "groups_per_batch": 4}},
                 group_size=2, eval={"episodes": 0})
    cfg["run"].update(total_steps=1, output_dir=str(out), concurrent_episodes=8)
    return parse_config({**cfg, "redis_url": redis_url})


async def answer_turns(coord: Coordinator, players: EnginePlayers, fail_group: str) -> None:
    """The rollout's part, with real engines: every turn on turns:{agent} generated and replied; the
    first turn of one episode of ``fail_group`` fails, as an engine error reaches the coordinator."""
    last = {coord.bus.streams.turns(a): "0-0" for a in ("A", "B")}
    failed: set[str] = set()
    while True:
        for stream, entries in await coord.bus.redis.xread(last, block=50) or []:
            for entry_id, fields in entries:
                last[stream.decode()] = entry_id.decode()
                req = decode(fields[FIELD], GenerateRequest)
                reply = await generate_on(players.engines[req.agent], req, f"test:{req.agent}")
                if req.group_id.startswith(fail_group) and not failed:
                    failed.add(req.episode_id)
                    reply = reply.model_copy(update={"error": "engine lost the request"})
                await coord.router.on_reply(reply)


async def check_agent(coord: Coordinator, agent: str, outcomes: dict) -> None:
    """The agent's groups: all emitted (no verdict yet), the samples on its stream exactly the ledger's
    members, each vouched for by the buffer's store; group 2's failed episode left one sample, emitted."""
    bus, cfg = coord.bus, coord.cfg
    state = coord.state.agents[agent]
    emitted = [g for g, o in outcomes.items() if o.state == "emitted"]
    # no verdict yet; a group with A and B launches while one of them still wants groups, so the other may
    # hold more than its batch (as when every group has both)
    assert state.in_flight_groups == len(emitted) >= cfg.agents[agent].groups_per_batch
    assert state.abandoned_groups == len(outcomes) - len(emitted)  # (an agent with no turn in a group)
    samples = [decode(f[FIELD], Sample) for _, f in await bus.redis.xrange(bus.streams.samples(agent))]
    store = SampleStore(bus, agent, groups_per_batch=4, max_staleness=0, filter_zero_variance=False)
    for gid in emitted:
        mine = [s for s in samples if s.group_id == gid]
        ids = await store.members(gid)
        assert sorted(s.id for s in mine) == sorted(ids or [])
        for s in mine:
            assert await store.vouch(s) == ids  # the buffer takes the group as the ledger records it
    group2 = [s for s in samples if s.group_id.startswith("g000002")]
    assert len(group2) == (1 if agent == "B" else 0)  # one of its 2 episodes failed; emitted with the rest


async def test_matchups_launch_groups_per_agent_and_a_failed_episode_is_counted(
        redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = run_config(redis_url, str(tiny_model_dir), tmp_path / "runs")
    bus = Bus(redis_url, "mx", "coordinator")
    coord = Coordinator(cfg, bus)
    await coord.restore()
    players = EnginePlayers({a: Engine(str(tiny_model_dir), weight_version=0) for a in ("A", "B")})
    server = asyncio.create_task(answer_turns(coord, players, "g000002"))
    loop = asyncio.create_task(coord.training_loop())
    try:
        for _ in range(1200):  # until neither agent wants a group (an abandoned one is replaced) and none plays
            if not any(a.wants_groups() for a in coord.state.agents.values()) and not coord.groups.tasks:
                break
            await asyncio.sleep(0.1)
        assert not coord.groups.tasks
        await asyncio.sleep(0.3)
        assert not loop.done()  # nobody wants the next group: the loop waits (for the buffer's verdicts)
    finally:
        for task in (loop, server):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        players.stop()
    launched = coord.state.groups_launched
    ledgers = {a: await coord.groups.ledger.outcomes(a) for a in ("A", "B")}
    members: dict[int, set[str]] = {}
    for agent, outcomes in ledgers.items():
        for gid in outcomes:
            members.setdefault(int(gid[1:7]), set()).add(agent)
    for index, agents in members.items():  # each group is in the ledger of exactly the agents its matchup trains
        assert agents == coord.groups.trained(coord.groups.roles_for_group(index)), index
    passed = set(range(launched)) - set(members)
    assert 4 in passed  # minimax vs A: A had its groups, B still wanted some: passed over, not waited on
    for agent, outcomes in ledgers.items():
        await check_agent(coord, agent, outcomes)
    assert int(await bus.redis.get(coord.groups.ledger.k_launched)) == max(members) + 1
    assert coord.state.status()["episodes_failed"] == {"train": {"total": 1, "B": 1}}
    restarted = Coordinator(cfg, Bus(redis_url, "mx", "coordinator"))
    await restarted.restore()
    assert restarted.state.episodes_failed == {"train": {"total": 1, "B": 1}}
    nxt = max(members) + 1  # a restart resumes after the last launched group, with the same schedule
    assert restarted.state.groups_launched == nxt and (
        restarted.groups.roles_for_group(nxt) == coord.groups.roles_for_group(nxt))
    await restarted.bus.close()
    await bus.close()


@pytest.mark.slow
def test_the_demo_mix_runs_through_tandem_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    """configs/demo.yaml (its matchups against minimax and random), made small, through ``tandem up``: both
    agents reach total_steps; each group is in the ledger of exactly the agents its matchup trains; no
    episode failed."""
    import json
    import shutil

    import redis
    import yaml

    from services.common.embedded_redis import EmbeddedRedis, free_port
    from services.contracts.streams import Streams
    from tests.helpers import REPO, launch_up

    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["run"].update(name="mixrun", total_steps=2, concurrent_episodes=8, checkpoint_root=str(tmp_path / "ckpt"),
                      output_dir=str(tmp_path / "runs"))
    cfg["api"]["port"] = free_port()
    cfg["environment"].update(group_size=4)
    cfg["environment"]["eval"].update(episodes=4, every_n_steps=0)
    for agent in cfg["agents"].values():
        agent.update(model_path=str(tiny_model_dir), groups_per_batch=2)
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with open(tmp_path / "launcher.log", "wb") as log:
        proc = launch_up(path, stdout=log)
        try:
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    assert proc.returncode == 0, (tmp_path / "launcher.log").read_text(errors="replace")[-4000:]
    summary = json.loads((tmp_path / "runs" / "mixrun" / "summary.json").read_text())
    assert summary["phase"] == "done" and summary["episodes_failed"] == {}
    for agent in ("A", "B"):
        assert summary["agents"][agent]["weight_versions"] == 2
    env = parse_config({**cfg, "redis_url": ""}).environment
    data = tmp_path / "redis-copy"
    shutil.copytree(tmp_path / "runs" / "mixrun" / "redis", data)
    with EmbeddedRedis(data_dir=data) as server:
        client = redis.Redis.from_url(server.url)
        members: dict[int, set[str]] = {}
        for agent in ("A", "B"):
            for gid in client.hkeys(Streams("mixrun").group_ledger(agent)):
                members.setdefault(int(gid[1:7]), set()).add(agent)
        client.close()
    assert members and all(agents == {p.agent for p in env.group_roles(i).values() if isinstance(p, AgentPlayer)}
                           for i, agents in members.items())
