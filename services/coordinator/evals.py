"""The coordinator's held-out evaluations (docs/architecture.md §8): start, every n steps, end, on demand.

Each evaluation plays every training agent against each of ``environment.eval``'s opponents
through services/play/evaluation.py, the code ``tandem eval`` runs, and appends one entry to the
run's evaluations. A frozen agent (``train: false``, always version 0) is evaluated too, on its
engines, at the start, the end and on demand (not every n steps: its weights never change), and
listed under ``frozen``; its scores stay out of the training agents' headline figures::

    {"label": "start" | "step-4" | "end" | "on-demand", "time": ..., "versions": {agent: version},
     "checkpoints": {agent: weights directory}, "opponents": [label, ...], "frozen": [agent, ...],
     "scores": {agent: headline score}, "details": {agent: headline report},
     "vs": {agent: {opponent: report}}}

The headline is the first opponent (``eval_start`` / ``eval_end``); a report is ``score``'s: score
± standard error, wins/draws/losses, the illegal or format-failure rate. Start and end play the
agents' engines, which then hold exactly version 0 and the last version. ``every_n_steps``
evaluations run beside training, whose engines move on meanwhile, so they play the checkpoint of
version k in-process as a ``Local`` player: the same weights ``tandem eval --checkpoint`` loads.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Literal

from services.contracts.messages import SamplingParams
from services.contracts.players import AgentPlayer, Local, Player
from services.play.episode import EpisodeResult
from services.play.evaluation import eval_roles, evaluate_against, fmt_report, opponent_label

if TYPE_CHECKING:
    from services.coordinator.scheduler import Coordinator

log = logging.getLogger("tandem.coordinator")


def step_label(version: int) -> str:
    return f"step-{version}"


def due_steps(every: int, total: int, done: set[str]) -> list[int]:
    """The versions an ``every``-step evaluation is still owed for (the last one is the end evaluation)."""
    return [k for k in range(every, total, every) if step_label(k) not in done] if every else []


async def evaluate(coord: Coordinator, agent: str, player: Player | None = None) -> dict[str, dict[str, Any]]:
    """``agent`` (its engines, or ``player``: a checkpoint) against every eval opponent: label -> report."""
    env_cfg = coord.cfg.environment
    ev = env_cfg.eval

    async def play(env: Any, gid: str, mapping: dict[str, Player], sampling: dict[Player, SamplingParams],
                   rng: random.Random) -> EpisodeResult | None:
        return await coord._play(env, f"{gid}-{agent}", mapping, "eval", sampling, rng)

    return await evaluate_against(coord.env_cls, env_cfg, player or AgentPlayer(agent=agent),
                                  eval_roles(env_cfg, coord.env_cls, agent), ev.opponent_list(), ev.episodes,
                                  coord.cfg.agents[agent].sampling, ev.temperature, play)


async def evaluate_all(coord: Coordinator, label: str, players: dict[str, Player] | None = None,
                       versions: dict[str, int] | None = None) -> dict[str, float | None]:
    """Evaluate every training agent (and, on their engines, the frozen ones); append the entry to ``coord.evals``;
    return the training agents' headline scores."""
    names = list(coord.state.agents)
    frozen = [] if players else [a for a, c in coord.cfg.agents.items() if not c.train]  # on their engines
    players = players or {}
    versions = {**(versions or {a: coord.state.agents[a].loaded_weight_version for a in names}),
                **dict.fromkeys(frozen, 0)}
    every = names + frozen
    reports = dict(zip(every, await asyncio.gather(*(evaluate(coord, a, players.get(a)) for a in every)),
                       strict=True))
    opponents = [opponent_label(o) for o in coord.cfg.environment.eval.opponent_list()]
    headline = {a: r[opponents[0]] for a, r in reports.items()}
    checkpoints = {a: coord.version_paths.get(a, {}).get(v) for a, v in versions.items()}
    coord.evals.append({"label": label, "time": time.time(), "versions": versions, "checkpoints": checkpoints,
                        "opponents": opponents, "frozen": frozen,
                        "scores": {a: r["score"] for a, r in headline.items()}, "details": headline,
                        "vs": reports})
    log.info("eval %s: %s", label, {f"{a} vs {o}": fmt_report(r) for a, vs in reports.items() for o, r in vs.items()})
    return {a: headline[a]["score"] for a in names}


async def at_edge(coord: Coordinator, label: Literal["start", "end"]) -> None:
    """The start or end evaluation: each training agent's headline score into its state (``eval_start``/
    ``eval_end``), the reports into the run record."""
    coord.state.phase = f"eval_{label}"
    for agent, score in (await evaluate_all(coord, label)).items():
        setattr(coord.state.agents[agent], f"eval_{label}", score)
    await coord.save_evals()


async def every_n_steps(coord: Coordinator) -> None:
    """Evaluate each agent's checkpoint of version k, for every k = n, 2n, ... below total_steps, once every
    agent has loaded it (one evaluation at a time, beside training); saved as they finish."""
    ev, total = coord.cfg.environment.eval, coord.cfg.run.total_steps
    if not ev.episodes:
        return
    for k in due_steps(ev.every_n_steps, total, {e["label"] for e in coord.evals}):
        async with coord.changed:
            await coord.changed.wait_for(lambda k=k: coord.state.stop_requested or all(
                a.loaded_weight_version >= k for a in coord.state.agents.values()))
        if coord.state.stop_requested:
            return
        paths = {a: coord.version_paths.get(a, {}).get(k) for a in coord.state.agents}
        if any(p is None for p in paths.values()):
            log.warning("no checkpoint path known for version %d of %s: its evaluation is skipped", k,
                        [a for a, p in paths.items() if p is None])
            continue
        players: dict[str, Player] = {a: Local(path=p, agent=a) for a, p in paths.items() if p is not None}
        try:
            await evaluate_all(coord, step_label(k), players, dict.fromkeys(players, k))
            await coord.save_evals()
        except Exception:  # a failed evaluation is logged; training goes on
            log.exception("evaluation %s failed", step_label(k))
