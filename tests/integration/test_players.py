"""Who plays a role: agents (A vs B, self-play), frozen agents, scripted players, opponent pools.

Also the episode loop with real tiny models played in-process, per-turn rewards, and
``tandem eval`` end to end on the tiny model (no services).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.bus import Bus
from services.contracts.config import ConfigError, parse_config
from services.contracts.players import AgentPlayer, Local, Pool, Scripted, parse_player
from services.coordinator.scheduler import Coordinator
from services.envs.guess_number import GuessNumber
from services.envs.registry import check_environment_config, load_environment
from services.envs.tictactoe import TicTacToe
from services.play.episode import play_episode
from services.play.evaluation import eval_roles, outcome
from services.play.local import LocalPlayers

REPO = Path(__file__).resolve().parents[2]


def config(roles: dict, agents: dict | None = None, env: str = "tictactoe", **env_extra) -> dict:
    agents = agents or {"A": {"model_path": "m"}, "B": {"model_path": "m"}}
    return {"run": {"name": "t"}, "environment": {"name": env, "roles": roles, **env_extra}, "agents": agents}


@pytest.mark.parametrize(("roles", "agents", "message"), [
    ({"X": "A", "O": "C"}, None, "environment.roles.O names agent 'C'"),
    ({"X": "A", "O": "pool:C"}, None, "environment.roles.O names agent 'C'"),
    ({"X": "A", "O": "bot:minimax"}, None, "environment.roles.O: 'bot:minimax' is not an agent name"),
    ({"X": "A", "O": "scripted:"}, None, "environment.roles.O"),
    ({"X": "A", "O": "A"}, {"A": {"model_path": "m", "train": False}}, "at least one must train"),
    ({"X": "A", "O": "scripted:random"}, {"A": {"model_path": "m"}, "B": {"model_path": "m"}},
     "agents.B: trains but plays no role"),
])
def test_role_players_are_checked_at_start(roles: dict, agents: dict | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(config(roles, agents))


@pytest.mark.parametrize("roles", [
    {"X": "A", "O": "B"}, {"X": "A", "O": "A"}, {"X": "A", "O": "scripted:minimax"}, {"X": "A", "O": "pool:A"},
    {"X": "A", "O": "B"},
])
def test_valid_player_kinds(roles: dict) -> None:
    agents = {"A": {"model_path": "m"}, "B": {"model_path": "m", "train": "B" in roles.values()}}
    cfg = parse_config(config(roles, agents))
    assert {r: str(p) for r, p in cfg.environment.roles.items()} == roles  # the YAML's strings, typed
    assert cfg.environment.roles == {r: parse_player(p) for r, p in roles.items()}
    assert parse_config(cfg.model_dump()).environment.roles == cfg.environment.roles  # dumps as the YAML form


def test_players_are_typed_once() -> None:
    assert parse_player("A") == AgentPlayer(agent="A")
    assert parse_player("scripted:random") == Scripted(name="random")
    assert parse_player("pool:A") == Pool(agent="A")
    for bad in ("bot:minimax", "scripted:", "pool:", "", 3):
        with pytest.raises(ValueError, match="is not an agent name"):
            parse_player(bad)


def test_frozen_agent_is_not_tracked_and_eval_roles(redis_url: str, tiny_model_dir: Path) -> None:
    m = str(tiny_model_dir)
    agents = {"A": {"model_path": m}, "B": {"model_path": m, "train": False}}
    cfg = parse_config({**config({"X": "A", "O": "B"}, agents), "redis_url": redis_url})
    coord = Coordinator(cfg, Bus(redis_url, "t", "coordinator"))
    assert set(coord.state.agents) == {"A"}  # B is frozen: no versions to wait for, no groups to count
    assert coord.groups.trained({"X": AgentPlayer(agent="A"), "O": AgentPlayer(agent="B")}) == {"A"}
    assert eval_roles(cfg.environment, TicTacToe, "A") == ["X"]
    asyncio.run(coord.bus.close())


def test_opponent_pool_draws_past_versions(redis_url: str, tiny_model_dir: Path) -> None:
    m = str(tiny_model_dir)
    cfg = parse_config({**config({"X": "A", "O": "pool:A"}, {"A": {"model_path": m}}, alternate_roles=True,
                                 pool_size=2), "redis_url": redis_url})
    coord = Coordinator(cfg, Bus(redis_url, "t", "coordinator"))
    a, pool = AgentPlayer(agent="A"), Pool(agent="A")
    assert coord.players.resolve_pool({"X": a, "O": pool}) == {"X": a, "O": Local(path=m, agent="A")}  # version 0 only
    from services.contracts.messages import WeightsLoaded
    from tests.helpers import commit_version

    async def load_versions() -> None:  # the trainer's commits and the rollout's record of each load, then its event
        for v in (1, 2, 3):
            await commit_version(coord.bus, "A", v, path=f"/ckpt/v{v}", loaded=True)
            await coord.events.on_event(WeightsLoaded(source="rollout", agent="A", weight_version=v, path=f"/ckpt/v{v}",
                                                      engines=[]))
        await coord.bus.close()

    asyncio.run(load_versions())
    drawn = {coord.players.resolve_pool({"X": a, "O": pool})["O"] for _ in range(50)}
    # the last pool_size versions, each knowing its owner from its type
    assert drawn == {Local(path="/ckpt/v2", agent="A"), Local(path="/ckpt/v3", agent="A")}
    assert coord.groups.roles_for_group(1) == {"X": pool, "O": a}  # sides alternate; the pool follows
    assert coord.groups.trained(coord.players.resolve_pool(coord.groups.roles_for_group(1))) == {"A"}
    v2 = Local(path="/ckpt/v2", agent="A")
    assert coord.players.sampling_for({"O": v2})[v2] == cfg.agents["A"].sampling


def test_self_play_episode_with_in_process_weights(tiny_model_dir: Path) -> None:
    """One player in both roles: two views, both token-exact; per-turn rewards reach the final ones."""
    local = LocalPlayers()
    player = Local(path=str(tiny_model_dir), agent="A")
    tok = local.tokenizer(str(tiny_model_dir))
    from services.contracts.messages import SamplingParams

    sampling = {player: SamplingParams(temperature=1.0, max_new_tokens=3, seed=5)}
    result = asyncio.run(play_episode(TicTacToe({}, 1), "e1", "g1", {"X": player, "O": player}, {player: tok},
                                      sampling, local.generate, "eval", random.Random(1)))
    assert set(result.views) == {"X", "O"} and any(result.views["X"].loss_mask)
    for view in result.views.values():  # O has no turn if X's first move was illegal (a random model)
        assert len(view.tokens) == len(view.loss_mask) == len(view.rollout_logprobs)
        assert all((lp <= 0) if m else lp == 0 for lp, m in zip(view.rollout_logprobs, view.loss_mask, strict=True))
    assert result.samples({}) == [] and result.samples({"A": 1}) == []  # in-process weights are never trained on
    again = asyncio.run(play_episode(TicTacToe({}, 1), "e2", "g1", {"X": player, "O": player}, {player: tok},
                                     sampling, local.generate, "eval", random.Random(1)))
    assert [t["text"] for t in again.transcript] == [t["text"] for t in result.transcript]  # seeded

    gn = asyncio.run(play_episode(GuessNumber({"max_turns": 3}, 0), "e3", "g2", {"guesser": Scripted(name="random")},
                                  {}, {}, local.generate, "eval", random.Random(0)))
    costs = sum(t["turn_rewards"].get("guesser", 0.0) for t in gn.transcript)
    final = 1.0 if gn.summary["found"] else 0.0
    assert gn.rewards["guesser"] == pytest.approx(final + costs) and costs < 0


def test_outcome() -> None:
    assert outcome({"X": 1.0, "O": -1.0}, "X") == "win"
    assert outcome({"X": 0.0, "O": 0.0}, "O") == "draw"
    assert outcome({"X": -1.0, "O": 0.0}, "X") == "loss"
    assert outcome({"guesser": 0.9}, "guesser") == "win"


def test_tandem_eval_reports_wins_draws_losses_vs_random_and_minimax(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = config({"X": "A", "O": "B"}, {"A": {"model_path": str(tiny_model_dir), "sampling": {"max_new_tokens": 2}},
                                        "B": {"model_path": str(tiny_model_dir), "sampling": {"max_new_tokens": 2}}},
                 alternate_roles=True, eval={"episodes": 4})
    cfg["run"]["output_dir"] = str(tmp_path / "runs")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "services.launcher.cli", "eval", str(path), "--checkpoint",
                           f"B={tiny_model_dir}", "--opponent", "random", "--opponent", "minimax", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for agent in ("A", "B"):
        for opp in ("random", "minimax"):
            s = report["agents"][agent]["vs"][opp]
            assert s["wins"] + s["draws"] + s["losses"] == s["episodes"] == 4
            assert set(s["per_role"]) == {"X", "O"}
            assert f"{agent} vs {opp}: score" in proc.stdout
        assert report["agents"][agent]["vs"]["minimax"]["wins"] == 0  # nobody beats minimax
    bad = subprocess.run([sys.executable, "-m", "services.launcher.cli", "eval", str(path), "--opponent", "alphazero"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--opponent alphazero" in bad.stderr


def test_tandem_envs_lists_every_builtin() -> None:
    proc = subprocess.run([sys.executable, "-m", "services.launcher.cli", "envs"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    for name in ("tictactoe", "guess_number", "twenty_questions", "debate", "doctor_patient", "math", "code",
                 "textarena"):
        assert name in proc.stdout
        assert ", ".join(load_environment(name).roles) in proc.stdout


def test_an_agent_that_never_gets_a_turn_stops_the_run(redis_url: str, tiny_model_dir: Path) -> None:
    from services.coordinator import groups

    m = str(tiny_model_dir)
    cfg = parse_config({**config({"X": "A", "O": "B"}, {"A": {"model_path": m}, "B": {"model_path": m}}),
                        "redis_url": redis_url})
    coord = Coordinator(cfg, Bus(redis_url, "t", "coordinator"))
    for _ in range(groups.MAX_EMPTY_GROUPS - 1):
        coord.groups.check_starved({"A", "B"}, {"A"})
    assert not coord.state.stop_requested
    coord.groups.check_starved({"A", "B"}, {"A", "B"})  # B had a turn: the streak restarts
    for _ in range(groups.MAX_EMPTY_GROUPS):
        coord.groups.check_starved({"A", "B"}, {"A"})
    assert coord.state.stop_requested and "agent B had no turn in 50 groups" in coord.state.error
    assert coord.state.status()["error"] == coord.state.error
    asyncio.run(coord.bus.close())


def test_a_prompt_past_the_context_ends_the_episode_as_truncated(tiny_model_dir: Path) -> None:
    from services.contracts.messages import SamplingParams
    from services.envs.textarena_adapter import TextArena

    local = LocalPlayers()
    player = Local(path=str(tiny_model_dir), agent="A")
    tok = local.tokenizer(str(tiny_model_dir))
    env = TextArena({"game": "TicTacToe-v0"}, 0)
    first_prompt = len(tok.encode(env.observation("P0")))
    result = asyncio.run(play_episode(env, "e", "g", {"P0": player, "P1": Scripted(name="random")}, {player: tok},
                                      {player: SamplingParams(max_new_tokens=2, seed=1)}, local.generate,
                                      "eval", random.Random(0), {player: first_prompt // 2}))
    assert result.summary["truncated"] and result.rewards == {"P0": 0.0, "P1": 0.0}
    assert result.transcript[-1]["truncated"] and result.views["P0"].tokens == []  # nothing past the limit


class NanReward(GuessNumber):
    """A buggy plug-in: its final reward is NaN."""

    async def step(self, role, text):
        result = await super().step(role, text)
        return dataclasses.replace(result, rewards={"guesser": float("nan")}, done=True)


def test_a_non_finite_reward_abandons_the_episode_and_never_reaches_a_sample() -> None:
    with pytest.raises(ValueError, match="non-finite rewards"):
        asyncio.run(play_episode(NanReward({"max_turns": 3}, 0), "e4", "g3", {"guesser": Scripted(name="random")},
                                 {}, {}, None, "eval", random.Random(0)))


def test_alternating_roles_may_not_rotate_a_scripted_player_into_a_role_it_cannot_play() -> None:
    roles = {"pro": "A", "con": "B", "judge": "scripted:rules"}
    with pytest.raises(ValueError, match="environment.alternate_roles"):
        check_environment_config(parse_config(config(roles, env="debate", alternate_roles=True,
                                                     eval={"episodes": 0})).environment)
    check_environment_config(parse_config(config(roles, env="debate", eval={"episodes": 0})).environment)
    tictactoe = parse_config(config({"X": "A", "O": "scripted:minimax"}, {"A": {"model_path": "m"}},
                                    alternate_roles=True))
    check_environment_config(tictactoe.environment)  # minimax plays either side
