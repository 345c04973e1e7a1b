"""The coordinator's held-out evaluations (docs/architecture.md §8): start, every n steps, end, on demand.

``Evaluations`` owns the run's evaluation reports (``entries``, in order; saved to the run record as
they finish) and plays them: each evaluation plays every training agent against each of
``environment.eval``'s opponents through services/play/evaluation.py, the code ``tandem eval`` runs,
its episodes played by the coordinator's episode log (episodes.py), and appends one entry. A frozen
agent (``train: false``, always version 0) is evaluated too, on its engines, at the start, the end
and on demand (not every n steps: its weights never change), and listed under ``frozen``; its scores
stay out of the training agents' headline figures::

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
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from services.contracts.config import TandemConfig
from services.contracts.messages import SamplingParams
from services.contracts.players import AgentPlayer, Local, Player
from services.coordinator.record import RunRecord
from services.coordinator.state import RunState
from services.envs.base import Environment
from services.play.episode import EpisodeResult
from services.play.evaluation import eval_roles, evaluate_against, fmt_report, opponent_label

log = logging.getLogger("tandem.coordinator")

# plays one episode: (env, group id, roles, purpose, sampling, rng) -> its result, None when abandoned
Play = Callable[[Any, str, dict[str, Player], str, dict[Player, SamplingParams], random.Random | None],
                Awaitable[EpisodeResult | None]]


def step_label(version: int) -> str:
    return f"step-{version}"


def due_steps(every: int, total: int, done: set[str]) -> list[int]:
    """The versions an ``every``-step evaluation is still owed for (the last one is the end evaluation)."""
    return [k for k in range(every, total, every) if step_label(k) not in done] if every else []


class Evaluations:
    def __init__(self, cfg: TandemConfig, env_cls: type[Environment], state: RunState, play: Play,
                 version_paths: dict[str, dict[int, str]], run_record: RunRecord, changed: asyncio.Condition) -> None:
        self.cfg, self.env_cls, self.state, self.play = cfg, env_cls, state, play
        self.version_paths = version_paths  # agent -> version -> weights directory (players.py)
        self.run_record, self.changed = run_record, changed  # changed: notified as versions load
        self.entries: list[dict[str, Any]] = []  # evaluation reports in order
        self.saved = 0  # reports already in the run record
        self.on_demand: asyncio.Task[dict[str, float | None]] | None = None

    def restore(self, entries: list[dict[str, Any]]) -> None:
        """The reports the run record holds (a restart does not repeat them)."""
        self.entries, self.saved = entries, len(entries)

    def labels(self) -> set[str]:
        return {e["label"] for e in self.entries}

    async def save(self) -> None:
        await self.run_record.add_evals(self.entries[self.saved:])
        self.saved = len(self.entries)  # after the write: a failed one is tried again

    def start_on_demand(self) -> bool:
        """Start an on-demand evaluation beside training; False while one is still running."""
        if self.on_demand is not None and not self.on_demand.done():
            return False
        self.on_demand = asyncio.create_task(self.evaluate_all("on-demand"))
        return True

    async def evaluate(self, agent: str, player: Player | None = None) -> dict[str, dict[str, Any]]:
        """``agent`` (its engines, or ``player``: a checkpoint) against every eval opponent: label -> report."""
        env_cfg = self.cfg.environment
        ev = env_cfg.eval

        async def play(env: Any, gid: str, mapping: dict[str, Player], sampling: dict[Player, SamplingParams],
                       rng: random.Random) -> EpisodeResult | None:
            return await self.play(env, f"{gid}-{agent}", mapping, "eval", sampling, rng)

        return await evaluate_against(self.env_cls, env_cfg, player or AgentPlayer(agent=agent),
                                      eval_roles(env_cfg, self.env_cls, agent), ev.opponent_list(), ev.episodes,
                                      self.cfg.agents[agent].sampling, ev.temperature, play)

    async def evaluate_all(self, label: str, players: dict[str, Player] | None = None,
                           versions: dict[str, int] | None = None) -> dict[str, float | None]:
        """Evaluate every training agent (and, on their engines, the frozen ones); append the entry to
        ``entries``; return the training agents' headline scores."""
        names = list(self.state.agents)
        frozen = [] if players else [a for a, c in self.cfg.agents.items() if not c.train]  # on their engines
        players = players or {}
        versions = {**(versions or {a: self.state.agents[a].loaded_weight_version for a in names}),
                    **dict.fromkeys(frozen, 0)}
        every = names + frozen
        reports = dict(zip(every, await asyncio.gather(*(self.evaluate(a, players.get(a)) for a in every)),
                           strict=True))
        opponents = [opponent_label(o) for o in self.cfg.environment.eval.opponent_list()]
        headline = {a: r[opponents[0]] for a, r in reports.items()}
        checkpoints = {a: self.version_paths.get(a, {}).get(v) for a, v in versions.items()}
        self.entries.append({"label": label, "time": time.time(), "versions": versions, "checkpoints": checkpoints,
                             "opponents": opponents, "frozen": frozen,
                             "scores": {a: r["score"] for a, r in headline.items()}, "details": headline,
                             "vs": reports})
        log.info("eval %s: %s", label, {f"{a} vs {o}": fmt_report(r) for a, vs in reports.items()
                                        for o, r in vs.items()})
        return {a: headline[a]["score"] for a in names}

    async def at_edge(self, label: Literal["start", "end"]) -> None:
        """The start or end evaluation: each training agent's headline score into its state (``eval_start``/
        ``eval_end``), the reports into the run record."""
        self.state.phase = f"eval_{label}"
        for agent, score in (await self.evaluate_all(label)).items():
            setattr(self.state.agents[agent], f"eval_{label}", score)
        await self.save()

    async def every_n_steps(self) -> None:
        """Evaluate each agent's checkpoint of version k, for every k = n, 2n, ... below total_steps, once every
        agent has loaded it (one evaluation at a time, beside training); saved as they finish."""
        ev, total = self.cfg.environment.eval, self.cfg.run.total_steps
        if not ev.episodes:
            return
        for k in due_steps(ev.every_n_steps, total, self.labels()):
            async with self.changed:
                await self.changed.wait_for(lambda k=k: self.state.stop_requested or all(
                    a.loaded_weight_version >= k for a in self.state.agents.values()))
            if self.state.stop_requested:
                return
            paths = {a: self.version_paths.get(a, {}).get(k) for a in self.state.agents}
            if any(p is None for p in paths.values()):
                log.warning("no checkpoint path known for version %d of %s: its evaluation is skipped", k,
                            [a for a, p in paths.items() if p is None])
                continue
            players: dict[str, Player] = {a: Local(path=p, agent=a) for a, p in paths.items() if p is not None}
            try:
                await self.evaluate_all(step_label(k), players, dict.fromkeys(players, k))
                await self.save()
            except Exception:  # a failed evaluation is logged; training goes on
                log.exception("evaluation %s failed", step_label(k))
