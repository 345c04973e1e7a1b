"""Tic-tac-toe environment: rules, rewards, format penalty, scripted players, parameters."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.contracts.config import EnvironmentConfig
from services.contracts.messages import SamplingParams
from services.contracts.players import Player, Scripted
from services.envs.base import Environment, EnvParamError, StepResult, score_for
from services.envs.params import describe, unshaped
from services.envs.registry import load_environment
from services.envs.tictactoe import (
    TicTacToe,
    best_moves,
    legal_cells,
    minimax_value,
    parse_move,
    tactical_miss,
    tactical_moves,
)
from services.play.episode import EpisodeResult, play_episode
from services.play.evaluation import play_eval, score


def play(env: TicTacToe, replies: list[str]) -> StepResult:
    """Feed replies for whoever is to move; return the last result."""
    result = StepResult(done=False)
    for reply in replies:
        result = asyncio.run(env.step(env.current_role(), reply))
    return result


def play_scripted(env: TicTacToe, players: dict[str, str], rng: random.Random) -> dict[str, float]:
    while True:
        role = env.current_role()
        result = asyncio.run(env.step(role, env.scripted_reply(role, players[role], rng)))
        if result.done:
            return result.rewards


def test_registry_and_initial_state() -> None:
    assert load_environment("tictactoe") is TicTacToe
    env = TicTacToe({}, seed=0)
    assert env.roles == ("X", "O")
    assert env.current_role() == "X"
    assert env.observation("X") == ".........|x"
    assert env.observation("O") == ".........|o"
    assert len(env.observation("X")) <= 12


def test_moves_alternate_and_show_in_observation() -> None:
    env = TicTacToe({}, seed=0)
    assert not play(env, ["5"]).done
    assert env.current_role() == "O"
    assert env.observation("O") == "....x....|o"
    assert not play(env, [" 1\n"]).done  # whitespace is stripped
    assert env.observation("X") == "o...x....|x"
    assert env.summary()["moves"] == [5, 1]


def test_win_and_loss_rewards() -> None:
    env = TicTacToe({}, seed=0)
    result = play(env, ["1", "4", "2", "5", "3"])  # X: 1 2 3
    assert result.done and result.rewards == {"X": 1.0, "O": -1.0}
    summary = env.summary()
    assert summary["winner"] == "X" and not summary["illegal"]
    assert summary["board"] == "xxxoo...."
    assert score_for(result.rewards, "X") == 1.0 and score_for(result.rewards, "O") == 0.0

    env = TicTacToe({}, seed=0)
    result = play(env, ["1", "3", "2", "5", "4", "7"])  # O: 3 5 7
    assert result.done and result.rewards == {"O": 1.0, "X": -1.0}
    assert env.summary()["winner"] == "O"


def test_draw() -> None:
    env = TicTacToe({}, seed=0)
    # x o x / x o o / o x x
    result = play(env, ["1", "2", "3", "5", "4", "6", "8", "7", "9"])
    assert result.done and result.rewards == {"X": 0.0, "O": 0.0}
    assert env.summary()["winner"] == "draw"
    assert score_for(result.rewards, "X") == 0.5


@pytest.mark.parametrize("reply", ["0", "10", "a", "", "5 5", "five", "<|end|>"])
def test_unparseable_reply_is_format_penalty(reply: str) -> None:
    env = TicTacToe({}, seed=0)
    play(env, ["5"])
    result = play(env, [reply])
    assert result.done and result.rewards == {"O": -1.0, "X": 0.0}
    assert result.info["illegal"] == "unparseable"
    summary = env.summary()
    assert summary["illegal"] and summary["winner"] is None


def test_occupied_cell_is_format_penalty() -> None:
    env = TicTacToe({}, seed=0)
    result = play(env, ["5", "1", "1"])
    assert result.done and result.rewards == {"X": -1.0, "O": 0.0}
    assert result.info["illegal"] == "occupied"


def test_illegal_reward_can_make_an_illegal_move_worse_than_a_loss() -> None:
    result = play(TicTacToe({"illegal_reward": -2.0}, seed=0), ["5", "1", "1"])
    assert result.rewards == {"X": -2.0, "O": 0.0}
    assert score_for(result.rewards, "X") == 0.0  # evaluations still score it as a loss
    for bad in (-0.5, 0.0, -11.0, "-2"):
        with pytest.raises(EnvParamError, match="illegal_reward"):
            TicTacToe({"illegal_reward": bad}, seed=0)


def test_wrong_turn_and_after_end_raise() -> None:
    env = TicTacToe({}, seed=0)
    with pytest.raises(ValueError, match="turn"):
        asyncio.run(env.step("O", "5"))
    play(env, ["1", "4", "2", "5", "3"])
    with pytest.raises(RuntimeError):
        asyncio.run(env.step("O", "9"))


def test_parse_and_helpers() -> None:
    assert parse_move(" 7 ") == 7
    assert parse_move("0") is None and parse_move("77") is None
    assert legal_cells("x.o......") == [2, 4, 5, 6, 7, 8, 9]
    assert minimax_value("." * 9, "X") == 0  # perfect play draws
    assert best_moves("xx.oo....", "X") == [3]  # take the win
    assert best_moves("xx..o....", "O") == [3]  # block


def test_scripted_random_is_legal() -> None:
    rng = random.Random(1)
    for seed in range(30):
        env = TicTacToe({}, seed=seed)
        play_scripted(env, {"X": "random", "O": "random"}, rng)
        assert not env.summary()["illegal"]


@pytest.mark.parametrize("minimax_role", ["X", "O"])
def test_minimax_never_loses_to_random(minimax_role: str) -> None:
    rng = random.Random(7)
    other = "O" if minimax_role == "X" else "X"
    wins = 0
    for seed in range(50):
        env = TicTacToe({}, seed=seed)
        rewards = play_scripted(env, {minimax_role: "minimax", other: "random"}, rng)
        assert rewards[minimax_role] >= 0.0, env.summary()
        wins += rewards[minimax_role] == 1.0
    assert wins >= 35


def test_tactical_wins_then_blocks_then_plays_anywhere() -> None:
    assert tactical_moves("xx.oo....", "X") == [3]  # its own win first, though O threatens 6
    assert tactical_moves("xx.oo....", "O") == [6]
    assert tactical_moves("xx..o....", "O") == [3]  # no win of its own: block
    assert tactical_moves("x...o....", "X") == legal_cells("x...o....")  # nothing forced: any empty cell
    env = TicTacToe({}, seed=0)
    play(env, ["1", "4", "2"])  # X threatens 3
    rng = random.Random(0)
    assert all(env.scripted_reply("O", "tactical", rng) == "3" for _ in range(5))


def test_tactical_misses_are_counted_per_role() -> None:
    assert tactical_miss("xx.oo....", "X", 7) == "win" and tactical_miss("xx.oo....", "X", 3) is None
    assert tactical_miss("xx..o....", "O", 9) == "block" and tactical_miss("xx..o....", "O", 3) is None
    assert tactical_miss("xx.xo...o", "O", 6) is None  # a fork: two threats, no move stops both
    assert tactical_miss("x...o....", "X", 9) is None  # nothing forced
    env = TicTacToe({}, seed=0)
    play(env, ["1", "4", "2", "9"])  # O does not block 3
    assert env.summary()["missed_blocks"] == {"X": 0, "O": 1}
    play(env, ["5"])  # X could win at 3 and plays 5 (now threatening 3 and 9 ... 9 is O's: only 3)
    assert env.summary()["missed_wins"] == {"X": 1, "O": 0}


def test_tactical_sits_between_random_and_minimax() -> None:
    """Against random the tactical player wins most games; against minimax it never wins."""
    rng = random.Random(5)
    vs_random = vs_minimax = 0.0
    for seed in range(60):
        me, other = ("X", "O") if seed % 2 == 0 else ("O", "X")
        vs_random += play_scripted(TicTacToe({}, seed=seed), {me: "tactical", other: "random"}, rng)[me]
        r = play_scripted(TicTacToe({}, seed=seed), {me: "tactical", other: "minimax"}, rng)[me]
        assert r <= 0.0
        vs_minimax += r
    assert vs_random / 60 > 0.5 and vs_minimax / 60 < 0.0


def test_minimax_vs_minimax_draws() -> None:
    rng = random.Random(3)
    for seed in range(5):
        env = TicTacToe({}, seed=seed)
        assert play_scripted(env, {"X": "minimax", "O": "minimax"}, rng) == {"X": 0.0, "O": 0.0}


def test_unknown_scripted_player() -> None:
    with pytest.raises(ValueError, match="scripted player"):
        TicTacToe({}, seed=0).scripted_reply("X", "greedy", random.Random(0))


def test_opening_moves_group_shares_start_and_seeds_differ() -> None:
    group = TicTacToe.make_group({"opening_moves": 3}, seed=11, size=4)
    assert len({env.board for env in group}) == 1
    env = group[0]
    assert env.board.count(".") == 6 and env.current_role() == "O"
    assert env.summary()["moves"] and env.summary()["opening_moves"] == 3
    boards = {TicTacToe({"opening_moves": 2}, seed=s).board for s in range(20)}
    assert len(boards) > 1


@pytest.mark.parametrize("params", [{"opening_moves": -1}, {"opening_moves": 5}, {"opening_moves": "2"},
                                    {"opening_moves": True}, {"opening_moves": 1.5}])
def test_bad_opening_moves_named(params: dict[str, object]) -> None:
    with pytest.raises(EnvParamError, match="opening_moves"):
        TicTacToe(params, seed=0)


def test_unknown_param_named() -> None:
    with pytest.raises(EnvParamError, match="board_size"):
        TicTacToe.check_params({"board_size": 4})


def test_tactic_penalty_charges_the_move_that_misses_a_win_or_the_block() -> None:
    env = TicTacToe({"tactic_penalty": 0.5}, seed=0)
    assert play(env, ["1", "5", "2"]).turn_rewards == {}  # X threatens 3
    missed_block = play(env, ["9"])  # O neither wins nor blocks 3
    assert missed_block.turn_rewards == {"O": -0.5} and not missed_block.done
    missed_win = play(env, ["4"])  # X could have won at 3
    assert missed_win.turn_rewards == {"X": -0.5}
    assert env.summary()["missed_blocks"] == {"X": 0, "O": 1} and env.summary()["missed_wins"] == {"X": 1, "O": 0}
    assert play(TicTacToe({}, seed=0), ["1", "5", "2", "9"]).turn_rewards == {}  # unshaped by default
    with pytest.raises(EnvParamError, match="tactic_penalty"):
        TicTacToe({"tactic_penalty": 1.5}, seed=0)


def test_evaluations_play_the_game_unshaped() -> None:
    """A shaped reward would turn a draw with a missed win into a "loss" (outcome compares rewards): evaluations
    build the environment without the shaping parameters and keep the others."""
    assert unshaped(TicTacToe.Params, {"tactic_penalty": 0.5, "illegal_reward": -2.0}) == {"illegal_reward": -2.0}
    shaped = TicTacToe({"tactic_penalty": 0.5, "opening_moves": 2}, seed=0).params  # the validated model too
    assert unshaped(TicTacToe.Params, shaped) == {"opening_moves": 2}
    assert any("[shaping" in line for line in describe(TicTacToe.Params) if line.startswith("tactic_penalty"))
    seen: list[tuple[float, float]] = []

    async def play_one(env: Environment, gid: str, roles: dict[str, Player], sampling: dict[Player, SamplingParams],
                       rng: random.Random) -> EpisodeResult:
        assert isinstance(env, TicTacToe)
        seen.append((env.params.tactic_penalty, env.params.illegal_reward))
        return await play_episode(env, gid, gid, roles, {}, sampling, None, "eval", rng, {})

    def report(params: dict[str, float]) -> dict[str, int]:
        cfg = EnvironmentConfig(name="tictactoe", params=params, roles={"X": "A", "O": "B"})
        results = asyncio.run(play_eval(TicTacToe, cfg, Scripted(name="random"), ["X", "O"], "tactical", 40,
                                        SamplingParams(), 0.0, play_one))
        r = score(results, ["X", "O"], "tactical")
        return {k: r[k] for k in ("wins", "draws", "losses")}

    plain = report({"illegal_reward": -2.0})
    assert report({"illegal_reward": -2.0, "tactic_penalty": 1.0}) == plain and sum(plain.values()) == 40
    assert set(seen) == {(0.0, -2.0)}
