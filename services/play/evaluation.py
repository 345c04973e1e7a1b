"""Held-out evaluation (docs/architecture.md §8): one player against the env's scripted opponents, seeded.

Used by the coordinator (at the start and end of a run, every ``eval.every_n_steps`` and on demand),
by ``tandem eval`` and by the demo's warm-start and RL sweep; ``score`` is the one report all of them
give (score ± standard error and its 95 % Wilson interval, wins/draws/losses, the illegal or
format-failure rate with its own; the interval stays honest where the SE is 0, every game lost or won,
``fmt_report`` prints both). Episode i
draws from seed ``7_000_000 + 1000 i``, so the same episodes, opponent moves and sampling draws come
back every time. The player takes, in turn, each role it
is evaluated in; roles the config gives a scripted player keep it (a rule-based judge); the
others are played by the opponent. An episode is a win when the player's reward beats the best
other role's (or is positive in a one-role environment), a draw when equal (zero), else a loss.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services.contracts.config import EnvironmentConfig
from services.contracts.messages import SamplingParams
from services.contracts.players import AgentPlayer, Player, Scripted
from services.envs.base import Environment, score_for
from services.envs.params import unshaped
from services.play.episode import EpisodeResult

EVAL_SEED = 7_000_000
Play = Callable[[Environment, str, dict[str, Player], dict[Player, SamplingParams], random.Random],
                Awaitable[EpisodeResult | None]]


def eval_roles(env_cfg: EnvironmentConfig, env_cls: type[Environment], agent: str) -> list[str]:
    """The roles ``agent`` is evaluated in: those it plays in the config (all when roles alternate)."""
    mine = [r for r in env_cls.roles if env_cfg.roles.get(r) == AgentPlayer(agent=agent)]
    free = [r for r in env_cls.roles if not isinstance(env_cfg.roles.get(r), Scripted)]
    return free if env_cfg.alternate_roles or not mine else mine


def outcome(rewards: dict[str, float], role: str) -> str:
    mine = rewards.get(role, 0.0)
    others = [v for r, v in rewards.items() if r != role]
    ref = max(others) if others else 0.0
    return "win" if mine > ref else "draw" if mine == ref else "loss"


def opponents_for(env_cls: type[Environment], env_cfg: EnvironmentConfig, opponent: str | dict[str, str],
                  ) -> dict[str, Scripted]:
    """Role -> the scripted player that plays it when it is not the evaluated player's."""
    fixed = env_cfg.scripted()  # e.g. a rule-based judge keeps its player
    return {r: fixed.get(r) or Scripted(name=opponent.get(r, "") if isinstance(opponent, dict) else opponent)
            for r in env_cls.roles if r in fixed or (opponent.get(r) if isinstance(opponent, dict) else opponent)}


async def play_eval(env_cls: type[Environment], env_cfg: EnvironmentConfig, player: Player, roles: list[str],
                    opponent: str | dict[str, str], episodes: int, base: SamplingParams, temperature: float,
                    play: Play) -> list[tuple[str, EpisodeResult]]:
    """Play ``episodes`` seeded episodes at once, without reward shaping (``unshaped``); return (the player's
    role, result) of those that finished."""
    others = opponents_for(env_cls, env_cfg, opponent)
    params = env_cls.evaluation_params(unshaped(env_cls.Params, env_cfg.env_params()))
    jobs = []
    for i in range(episodes):
        seed = EVAL_SEED + 1000 * i
        sampling = {player: base.model_copy(update={"temperature": temperature, "seed": seed})}
        mine = roles[i % len(roles)]
        mapping: dict[str, Player] = {r: (player if r == mine else others[r]) for r in env_cls.roles}
        jobs.append((mine, play(env_cls(params, seed), f"eval-{i}", mapping, sampling, random.Random(seed))))
    results = await asyncio.gather(*(j for _, j in jobs))
    return [(mine, r) for (mine, _), r in zip(jobs, results, strict=True) if r is not None]


def mean_se(xs: list[float]) -> tuple[float | None, float | None]:
    """The mean and its standard error (sample std / sqrt(n); None below two values)."""
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def wilson(p: float | None, n: int, z: float = 1.96) -> list[float] | None:
    """The Wilson score interval [lo, hi] (95 % by default) of a proportion ``p`` over ``n`` trials (a score
    with draws as half a win counts as a proportion); None without trials. Unlike ``p ± z·SE`` it is not
    empty when ``p`` is 0 or 1: 0 wins in 200 games gives [0, 0.019]."""
    if p is None or n <= 0:
        return None
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return [round(max(0.0, centre - half), 6), round(min(1.0, centre + half), 6)]


def fmt_report(r: dict[str, Any]) -> str:
    """One report on a line. A game: ``0.512 ± 0.025 [0.46, 0.56] (w/d/l 90/25/85, illegal 0.030 [0.01, 0.06])``;
    any other environment (``game`` false): its own measures, ``found 0.400, turns 3.100 (illegal 0.030 [..])``."""
    def interval(ci: list[float] | None) -> str:
        return "" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]"

    if r.get("score") is None:
        return "-"
    illegal = "-" if r.get("illegal_rate") is None else f"{r['illegal_rate']:.3f}{interval(r.get('illegal_rate_ci95'))}"
    if not r.get("game", True):
        means = r.get("summary_means") or {}
        shown = ", ".join(f"{k} {v:.3f}" for k, v in means.items()) or f"mean reward {r.get('mean_reward', 0.0):.3f}"
        return f"{shown} (illegal {illegal})"
    se = "" if r.get("score_se") is None else f" ± {r['score_se']:.3f}"
    wdl = f"w/d/l {r['wins']}/{r['draws']}/{r['losses']}, " if "wins" in r else ""
    return f"{r['score']:.3f}{se}{interval(r.get('score_ci95'))} ({wdl}illegal {illegal})"


def score(results: list[tuple[str, EpisodeResult]], roles: list[str], opponent: str | dict[str, str],
          measures: Sequence[str] | None = None, game: bool = True) -> dict[str, Any]:
    """The one evaluation report (in-run and ``tandem eval`` alike), from ``play_eval``'s results: the score
    (win 1, draw 1/2, loss 0) with its standard error and 95 % Wilson interval, wins/draws/losses, the illegal
    or format-failure rate (episodes in which the player's reply was illegal or malformed, episode.py) with
    its standard error and Wilson interval and per reply, the mean reward, the per-role scores and
    ``summary_means``, the mean of each number (or yes/no) of the environment's episode summaries (for
    guess_number: ``found``, ``turns``, ``malformed``: the true score when the reward is shaped), or of the
    fields ``measures`` names (the environment's ``summary_measures``). ``game`` (the environment's ``is_game``)
    says whether the win/draw/loss score means anything: where it does not, the report's readers show
    ``summary_means`` instead (``fmt_report``, the dashboard)."""
    counts = {"win": 0, "draw": 0, "loss": 0}
    per_role: dict[str, list[float]] = {r: [] for r in roles}
    rewards: list[float] = []
    invalid: list[float] = []
    replies = invalid_replies = 0
    for mine, r in results:
        counts[outcome(r.rewards, mine)] += 1
        per_role[mine].append(score_for(r.rewards, mine))
        rewards.append(r.rewards.get(mine, 0.0))
        n, bad = r.replies(mine)
        replies, invalid_replies = replies + n, invalid_replies + bad
        invalid.append(1.0 if bad else 0.0)
    scores = [x for xs in per_role.values() for x in xs]
    mean, se = mean_se(scores)
    illegal, illegal_se = mean_se(invalid)
    return {"score": mean, "score_se": se, "score_ci95": wilson(mean, len(scores)), "game": game,
            "episodes": len(scores), "opponent": opponent,
            "wins": counts["win"], "draws": counts["draw"], "losses": counts["loss"],
            "illegal_rate": illegal, "illegal_rate_se": illegal_se, "illegal_rate_ci95": wilson(illegal, len(invalid)),
            "illegal_episodes": int(sum(invalid)),
            "illegal_reply_rate": invalid_replies / replies if replies else None,
            "mean_reward": sum(rewards) / max(len(rewards), 1),
            "per_role": {r: (sum(xs) / len(xs) if xs else None) for r, xs in per_role.items()},
            "summary_means": summary_means([r.summary for _, r in results], measures,
                                           [mine for mine, _ in results])}


def summary_means(summaries: list[dict[str, Any]], measures: Sequence[str] | None = None,
                  roles: Sequence[str] | None = None) -> dict[str, float]:
    """The mean over episodes of each number or yes/no of the environment's summaries that every one of
    them has (True counts 1); only the fields in ``measures`` when given. With ``roles`` (the evaluated
    player's role in each episode), a field that maps roles to numbers (tic-tac-toe's ``missed_wins``)
    counts that player's number."""
    def value(s: dict[str, Any], k: str, i: int) -> Any:
        v = s.get(k)
        return v.get(roles[i]) if isinstance(v, dict) and roles is not None else v

    keys = [k for k in (summaries[0] if summaries else {}) if measures is None or k in measures]
    common = [k for k in keys if all(isinstance(value(s, k, i), int | float) for i, s in enumerate(summaries))]
    return {k: sum(float(value(s, k, i)) for i, s in enumerate(summaries)) / len(summaries) for k in common}


def opponent_label(opponent: str | dict[str, str]) -> str:
    """How reports name an opponent: the scripted player, or ``role:player,...`` for one per role."""
    return opponent if isinstance(opponent, str) else ",".join(f"{r}:{p}" for r, p in opponent.items())


async def evaluate_player(env_cls: type[Environment], env_cfg: EnvironmentConfig, player: Player,
                          roles: list[str], opponent: str | dict[str, str], episodes: int, base: SamplingParams,
                          temperature: float, play: Play) -> dict[str, Any]:
    """Play ``episodes`` seeded episodes; return score (0-1), wins/draws/losses and per-role scores."""
    results = await play_eval(env_cls, env_cfg, player, roles, opponent, episodes, base, temperature, play)
    return score(results, roles, opponent, env_cls.summary_measures, env_cls.is_game)


async def evaluate_against(env_cls: type[Environment], env_cfg: EnvironmentConfig, player: Player,
                           roles: list[str], opponents: list[str | dict[str, str]], episodes: int,
                           base: SamplingParams, temperature: float, play: Play) -> dict[str, dict[str, Any]]:
    """``evaluate_player`` against each opponent in turn: opponent label -> report (``score``)."""
    return {opponent_label(o): await evaluate_player(env_cls, env_cfg, player, roles, o, episodes, base,
                                                     temperature, play) for o in opponents}
