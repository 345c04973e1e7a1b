"""Evaluation a researcher can trust: the one report (score ± standard error, wins/draws/losses, illegal rate),
several opponents and ``every_n_steps`` in the config, seeded minimax tie-breaks, and the training episodes'
illegal / format-failure rate per agent in the coordinator's state, ``/v1/status``, ``/metrics``,
``summary.json``, the plot and the live view (real tiny models, real Redis)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.bus import Bus
from services.contracts.config import ConfigError, EnvironmentConfig, parse_config
from services.contracts.messages import SamplingParams
from services.contracts.players import AgentPlayer, Player
from services.coordinator.api import create_app
from services.coordinator.report import eval_curves, write_report
from services.coordinator.scheduler import Coordinator
from services.coordinator.train_play import PlayCounts, recent
from services.envs.guess_number import GuessNumber
from services.envs.registry import check_environment_config
from services.envs.tictactoe import TicTacToe, best_moves
from services.inference.generator import Engine
from services.launcher.live_view import eval_table
from services.launcher.up import status_table
from services.play.episode import EpisodeResult
from services.play.evaluation import evaluate_against, fmt_report, mean_se, score, summary_means, wilson
from services.play.local import EnginePlayers


def config(tmp_path: Path, model: str = "m", **eval_cfg: object) -> dict:
    agent = {"model_path": model, "sampling": {"max_new_tokens": 2}}
    return {"run": {"name": "t", "output_dir": str(tmp_path / "runs")},
            "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}, "alternate_roles": True,
                            "eval": eval_cfg},
            "agents": {"A": agent, "B": agent}}


def test_eval_config_takes_one_opponent_or_several(tmp_path: Path) -> None:
    assert parse_config(config(tmp_path)).environment.eval.opponent_list() == ["random"]
    assert parse_config(config(tmp_path, opponent="minimax")).environment.eval.opponent_list() == ["minimax"]
    ev = parse_config(config(tmp_path, opponents=["random", "minimax"], every_n_steps=4)).environment.eval
    assert ev.opponent_list() == ["random", "minimax"] and ev.every_n_steps == 4
    with pytest.raises(ConfigError, match="either opponent or opponents"):
        parse_config(config(tmp_path, opponent="random", opponents=["minimax"]))
    with pytest.raises(ConfigError, match="every_n_steps"):
        parse_config(config(tmp_path, every_n_steps=-1))
    bad = parse_config(config(tmp_path, opponents=["random", "perfect"]))
    with pytest.raises(ValueError, match=r"environment.eval.opponents\[1\]"):
        check_environment_config(bad.environment)


def test_minimax_breaks_ties_at_random_from_the_seed() -> None:
    env = TicTacToe({}, 0)
    assert best_moves(env.board, "X") == list(range(1, 10))  # every opening draws under perfect play
    draws = [[env.scripted_reply("X", "minimax", random.Random(seed)) for _ in range(3)] for seed in (1, 1, 2)]
    assert draws[0] == draws[1] and len({m for d in draws for m in d}) > 1
    env.board = "xx.oo...."  # X to move: 3 wins, nothing else does
    assert {env.scripted_reply("X", "minimax", random.Random(s)) for s in range(20)} == {"3"}


def test_mean_and_standard_error() -> None:
    xs = [1.0, 0.5, 0.0, 1.0]
    m, se = mean_se(xs)
    assert m == pytest.approx(0.625) and se == pytest.approx(statistics.stdev(xs) / math.sqrt(4))
    assert mean_se([1.0]) == (1.0, None) and mean_se([]) == (None, None)


def test_the_wilson_interval_is_honest_where_the_standard_error_is_zero() -> None:
    lost = {"score": 0.0, "score_se": 0.0, "score_ci95": wilson(0.0, 200), "wins": 0, "draws": 0, "losses": 200,
            "illegal_rate": 0.0, "illegal_rate_ci95": wilson(0.0, 200)}
    assert lost["score_ci95"] == [0.0, pytest.approx(3.8415 / 203.8415, abs=1e-6)]  # z^2 / (n + z^2)
    assert wilson(1.0, 200) == [pytest.approx(1 - 3.8415 / 203.8415, abs=1e-6), 1.0]
    lo, hi = wilson(0.3, 100)
    assert lo < 0.3 < hi and (hi - lo) / 2 == pytest.approx(1.96 * math.sqrt(0.21 / 100), rel=0.05)
    assert wilson(None, 0) is None and wilson(0.5, 0) is None
    assert fmt_report(lost) == "0.000 ± 0.000 [0.000, 0.019] (w/d/l 0/0/200, illegal 0.000 [0.000, 0.019])"


def test_report_means_the_environments_episode_summaries() -> None:
    """A shaped reward is not the true score: the report also means the env's summaries (turns, found)."""
    results = []
    for seed in range(6):
        env, rng, total = GuessNumber({"high": 16, "max_turns": 3, "info_shaping": 1.0}, seed), random.Random(0), 0.0
        while True:
            step = asyncio.run(env.step("guesser", env.scripted_reply("guesser", "random", rng)))
            total += step.turn_rewards["guesser"] + step.rewards.get("guesser", 0.0)
            if step.done:
                break
        results.append(("guesser", EpisodeResult(f"e{seed}", "g", {}, {"guesser": total}, [], {}, env.summary(),
                                                 "eval")))
    report = score(results, ["guesser"], "bisect", GuessNumber.summary_measures)
    summaries = [r.summary for _, r in results]
    assert report["summary_means"] == {"found": pytest.approx(sum(s["found"] for s in summaries) / 6),
                                       "turns": pytest.approx(statistics.mean(s["turns"] for s in summaries)),
                                       "malformed": 0.0}  # the hidden target is not a measure
    assert score(results, ["guesser"], "bisect")["summary_means"]["target"] == pytest.approx(
        statistics.mean(s["target"] for s in summaries))  # without measures: every number
    assert summary_means([]) == {} and summary_means([{"a": 1, "b": "x"}, {"a": 3}]) == {"a": 2.0}
    assert summary_means([{"a": 1, "b": 2}, {"a": 3, "b": 4}], ("b",)) == {"b": 3.0}
    per_role = [{"m": {"X": 1, "O": 0}}, {"m": {"X": 5, "O": 2}}]
    assert summary_means(per_role, ("m",), ["X", "O"]) == {"m": 1.5}  # the evaluated player's own: 1 and 2
    assert summary_means(per_role, ("m",)) == {}  # a per-role field without the roles is no number


def test_report_counts_illegal_replies_per_episode(tiny_model_dir: Path) -> None:
    """The untrained tiny model replies out of format often: the report's rate is the episodes with an
    ``invalid`` turn of the evaluated player, with its standard error, against each opponent."""
    env_cfg = EnvironmentConfig(name="tictactoe", roles={"X": "A", "O": "A"}, alternate_roles=True)
    a = AgentPlayer(agent="A")
    kept: list = []

    async def go() -> dict:
        players = EnginePlayers({"A": Engine(tiny_model_dir)})

        async def play(env, gid, roles: dict[str, Player], sampling, rng):
            result = await players.play(env, gid, gid, roles, sampling, "eval", rng)
            kept.append((gid, result))
            return result

        try:
            return await evaluate_against(TicTacToe, env_cfg, a, ["X", "O"], ["random", "minimax"], 10,
                                          SamplingParams(max_new_tokens=2), 1.0, play)
        finally:
            players.stop()

    reports = asyncio.run(go())
    assert list(reports) == ["random", "minimax"]
    minimax = reports["minimax"]
    assert minimax["wins"] == 0 and minimax["episodes"] == 10
    results = kept[10:]  # the minimax half
    flags = [float(any(t.get("invalid") for t in r.transcript if r.roles[t["role"]] == a)) for _, r in results]
    assert minimax["illegal_rate"] == pytest.approx(sum(flags) / 10) and 0 < sum(flags) <= 10
    assert minimax["illegal_rate_se"] == pytest.approx(mean_se(flags)[1])
    assert minimax["illegal_episodes"] == int(sum(flags)) and minimax["score_se"] is not None
    for r in reports.values():  # the 95 % Wilson intervals beside the standard errors
        assert r["score_ci95"] == wilson(r["score"], 10) and r["score_ci95"][0] <= r["score"] <= r["score_ci95"][1]
        assert r["illegal_rate_ci95"] == wilson(r["illegal_rate"], 10)
    for _, r in results:  # an illegal reply ends tic-tac-toe: it is the last turn and says why
        bad = [t for t in r.transcript if t.get("invalid")]
        assert all(t is r.transcript[-1] and t["invalid"].startswith("illegal:") for t in bad)


def test_training_illegal_rate_in_status_metrics_summary_and_live_view(redis_url: str, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    cfg = parse_config(config(tmp_path, str(tiny_model_dir), opponents=["random", "minimax"]) | {
        "redis_url": redis_url})

    async def go() -> tuple[dict, dict, Coordinator]:
        coord = Coordinator(cfg, Bus(redis_url, "evalrep", "coordinator"))
        players = EnginePlayers({"A": Engine(tiny_model_dir), "B": Engine(tiny_model_dir)})
        a, b = AgentPlayer(agent="A"), AgentPlayer(agent="B")
        sampling = {p: SamplingParams(max_new_tokens=2) for p in (a, b)}
        try:
            for i in range(6):  # alternating sides, as the demo does
                roles: dict[str, Player] = {"X": a, "O": b} if i % 2 == 0 else {"X": b, "O": a}
                result = await players.play(TicTacToe({}, i), f"e{i}", "g", roles, sampling, "train",
                                            random.Random(i))
                await coord.episode_log.record(result)
        finally:
            players.stop()
        transport = httpx.ASGITransport(app=create_app(coord))
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            status = (await client.get("/v1/status")).json()
            metrics = (await client.get("/metrics")).text
        again = Coordinator(cfg, Bus(redis_url, "evalrep", "coordinator"))
        await again.restore()
        return status, {(s.name, s.labels.get("agent")): s.value for f in text_string_to_metric_families(metrics)
                        for s in f.samples}, again

    status, series, restored = asyncio.run(go())
    counts = {a: recent(restored.state.agents[a].train_play) for a in ("A", "B")}
    assert 3 <= counts["A"].episodes <= 6 and 3 <= counts["B"].episodes <= 6  # as O only if X's reply was legal
    for agent, c in counts.items():
        rate = c.invalid_episodes / c.episodes
        assert status["agents"][agent]["illegal_rate"] == pytest.approx(rate)  # restored = live
        assert series[("tandem_train_illegal_rate", agent)] == pytest.approx(rate)
        assert series[("tandem_train_episodes_total", agent)] == c.episodes
        assert series[("tandem_train_illegal_episodes_total", agent)] == c.invalid_episodes
    assert sum(c.invalid_episodes for c in counts.values()) > 0  # the untrained model plays out of format

    status["evals"] = [{"label": "start", "vs": {"A": {"random": {"score": 0.5, "score_se": 0.1,
                                                                  "illegal_rate": 0.25}}}}]
    table = status_table(status)
    assert "illegal" in [c.header for c in table.columns] and table.columns[-1]._cells[0] == "vs random 0.50"
    assert ["A", "random", "0.500 ± 0.100", "0.25"] == [c._cells[0] for c in eval_table(status["evals"][0]).columns]

    path = write_report(restored.state, [], cfg.run_dir(), 1.0)
    summary = json.loads(path.read_text())
    assert summary["agents"]["A"]["train_illegal_rate"] == pytest.approx(
        counts["A"].invalid_episodes / counts["A"].episodes)
    assert summary["agents"]["A"]["train_play"][0]["weight_version"] == 0
    assert (cfg.run_dir() / "rewards.png").stat().st_size > 10_000


def test_eval_curves_per_opponent_with_older_entries() -> None:
    report = {"score": 0.5, "score_se": 0.05, "wins": 1, "draws": 2, "losses": 1, "episodes": 4,
              "illegal_rate": 0.0, "illegal_rate_se": 0.0}
    evals = [{"label": "end", "versions": {"A": 4}, "vs": {"A": {"random": report, "minimax": report}}},
             {"label": "start", "versions": {"A": 0}, "details": {"A": {"opponent": "random", "score": 0.25}}}]
    curves = eval_curves(evals, "A")
    assert [p["step"] for p in curves["random"]] == [0, 4] and curves["random"][0]["score"] == 0.25
    assert curves["minimax"] == [{"label": "end", "step": 4, **{k: report.get(k) for k in curves["minimax"][0]
                                                               if k not in ("label", "step")}}]


def test_play_counts_report() -> None:
    c = PlayCounts(episodes=4, invalid_episodes=1, replies=10, invalid_replies=1, reward=-1.0)
    r = c.report()
    assert r["illegal_rate"] == 0.25 and r["illegal_reply_rate"] == 0.1 and r["mean_reward"] == -0.25
    assert PlayCounts().report()["illegal_rate"] is None
    by_version = {0: PlayCounts(episodes=50, invalid_episodes=50), 1: PlayCounts(episodes=40), 2: PlayCounts(30)}
    assert recent(by_version, least=64).episodes == 70 and recent(by_version, least=64).invalid_episodes == 0
