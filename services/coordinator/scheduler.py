"""The coordinator service's run: gated group launches beside evaluations, then the report and the end.

``Coordinator`` wires the run's parts and runs the loop. The parts: the turn router (router.py: turns out,
replies back), the players (players.py: tokenizers, each agent's pool of versions), the episode log
(episodes.py: each episode played in a slot, within its agents' share of them (slots.py), and recorded), the
evaluations (evals.py: their reports and runs), the group play (groups.py: a group launched, played, emitted
or abandoned) and the events folded into the run state (events.py). The stream handlers are
``router.on_reply`` (replies), ``events.on_event`` (events) and ``on_control`` (control). Main loop (``run``):
evaluate every agent against the env's scripted opponents; launch GRPO groups while the staleness gate allows
(state.py) and the run is not paused (past a group whose agents' gates are closed, to the next whose are
open), evaluating every ``eval.every_n_steps`` beside them; when every agent has loaded its last version,
evaluate again, write the report and tell all services to stop. Restartable: ``restore`` rebuilds the run
state from Redis (record.py, ledger.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from services.common.bus import Bus
from services.common.reconnect import REDIS_DOWN
from services.contracts.config import TandemConfig
from services.contracts.messages import Control
from services.contracts.players import Player
from services.coordinator import play_archive
from services.coordinator.episodes import EpisodeLog
from services.coordinator.evals import Evaluations
from services.coordinator.events import RunEvents
from services.coordinator.groups import GroupPlay
from services.coordinator.ledger import GroupLedger, horizons
from services.coordinator.players import Players
from services.coordinator.record import RunRecord, restore_run
from services.coordinator.replies import ReplyCheck
from services.coordinator.report import write_report
from services.coordinator.router import TurnRouter
from services.coordinator.state import RunState
from services.envs.registry import check_environment_config

log = logging.getLogger("tandem.coordinator")
LOOKAHEAD = 64  # group indices looked at past held ones (the matchup cycle is far shorter)


class Coordinator:
    def __init__(self, cfg: TandemConfig, bus: Bus, name: str = "coordinator") -> None:
        self.cfg, self.bus = cfg, bus
        self.state = RunState.from_config(cfg)
        env_cls = check_environment_config(cfg.environment)  # a ValueError names the field that does not fit
        self.run_record = RunRecord(bus, cfg.run.checkpoint_root)
        self.players = Players(cfg)
        # engine replies are checked before they enter an episode (replies.py)
        self.router = TurnRouter(bus, name, ReplyCheck(cfg, bus), self.players.local)
        self.events = RunEvents(cfg, bus, self.state, self.players, asyncio.Condition())
        self.episode_log = EpisodeLog(cfg, bus, self.state, self.players, self.router.generate, self.run_record)
        self.evaluations = Evaluations(cfg, env_cls, self.state, self.episode_log.play,
                                       self.players.version_paths, self.run_record, self.events.changed)
        ledger = GroupLedger(bus, list(self.state.agents), cfg.run_dir(), horizons(cfg))
        self.groups = GroupPlay(cfg, self.state, env_cls, self.players, self.episode_log, ledger, self.events.notify)

    @property
    def name(self) -> str:
        """The coordinator's name: its consumer name and its reply stream's."""
        return self.router.name

    @property
    def episodes(self) -> dict[str, dict[str, Any]]:
        """The recent episode records (episodes.py), newest last."""
        return self.episode_log.recent

    @property
    def evals(self) -> list[dict[str, Any]]:
        """The evaluation reports in order (evals.py)."""
        return self.evaluations.entries

    async def restore(self) -> None:
        """Rebuild the run state from Redis (record.py): a first start finds it empty, a restart the run."""
        evals, paths = await restore_run(self.state, self.run_record, self.groups.ledger)
        self.evaluations.restore(evals)
        for agent, loaded in paths.items():
            versions = await self.run_record.versions(agent)
            self.players.restore(agent, loaded, {r.weight_version: r.path for r in versions.loaded_records})
        await self.episode_log.restore(self.cfg.run_dir())

    async def on_control(self, cmd: Control) -> None:
        """A ``stop`` from elsewhere ends the run gracefully; the coordinator's own final one changes nothing."""
        if cmd.command == "stop" and self.state.phase not in ("done", "stopped"):
            await self.control("stop")

    async def control(self, command: str) -> None:
        """pause / resume / stop the run, recorded in Redis (a restart keeps it). ``stop`` ends it gracefully: no
        new groups, the report is written, and only then are the other services told to stop."""
        if command == "pause":
            self.state.paused = True
        elif command == "resume":
            self.state.paused = False
        elif command == "stop":
            self.state.stop_requested = True
        await self.run_record.set(paused=self.state.paused, stop_requested=self.state.stop_requested)
        await self.events.notify()

    # --- the run loop and the gate ---------------------------------------------
    def passes_over(self, roles: dict[str, Player]) -> bool:
        """A matchup whose agents want no group is passed over while another agent wants some (not stalled)."""
        if any(self.state.agents[a].wants_groups() for a in self.groups.trained(roles)):
            return False
        return any(a.wants_groups() for a in self.state.agents.values())

    def next_group(self) -> tuple[int, dict[str, Player]] | None:
        """The group to launch (or pass over) now, or None to wait: the lowest index not yet launched whose
        training agents may launch. A group whose training agents are all held (a closed gate, or no group
        wanted) is skipped and launched once they open, so one agent's stall does not stop another's groups;
        one where some may launch waits for the rest, and so do the groups behind it. Each agent's groups
        still launch in index order, and a restart launches the same ones (``launched_ahead``, ledger.py)."""
        first = True
        for index in self.state.unlaunched(LOOKAHEAD):
            roles = self.groups.roles_for_group(index)
            if index == self.state.groups_launched and self.passes_over(roles):
                return index, roles
            wanting = [self.state.agents[a] for a in sorted(self.groups.trained(roles))
                       if self.state.agents[a].wants_groups()]
            if not wanting:
                continue
            # the first group held is noted in ``gate_wait`` for /v1/status
            blocked = (self.state.closed_gates(index, wanting) if first
                       else [a.name for a in wanting if a.blocked_by_staleness()])
            if not blocked:
                return index, roles
            if len(blocked) < len(wanting):
                return None
            first = False
        return None

    async def training_loop(self) -> None:
        self.state.phase = "training"
        changed = self.events.changed
        while not self.state.stop_requested:
            async with changed:
                await changed.wait_for(lambda: self.state.stop_requested or self.all_finished() or (
                    not self.state.paused and self.next_group() is not None))
            if self.state.stop_requested or self.all_finished():
                break
            if (chosen := self.next_group()) is None:
                continue
            index, roles = chosen
            if index == self.state.groups_launched and self.passes_over(roles):
                # no ledger entry: nobody trains on it; a restart passes it again
                self.state.groups_launched, self.state.launched_ahead = self.state.after_launch(index)
                if self.state.gate_wait is not None and self.state.gate_wait.index == index:
                    self.state.gate_wait = None
                continue
            await self.groups.launch(index, roles)
            self.state.launched(index)  # into groups_launched, or launched_ahead past a held group

    def all_finished(self) -> bool:
        return all(a.finished for a in self.state.agents.values())

    async def run(self) -> None:
        """The run from where the run record stands: evaluations already done are not repeated."""
        await self.events.wait_for_engines()
        done = self.evaluations.labels()
        if self.cfg.environment.eval.episodes and "start" not in done:
            await self.evaluations.at_edge("start")
        periodic = asyncio.create_task(self.evaluations.every_n_steps())
        await self.training_loop()
        await self.groups.finish(cancel=self.state.stop_requested)
        if self.state.stop_requested:
            periodic.cancel()
        await asyncio.gather(periodic, return_exceptions=True)  # the last every-n evaluation, then the end one
        await self.run_record.set(stop_requested=self.state.stop_requested, error=self.state.error)
        if not self.state.stop_requested and self.cfg.environment.eval.episodes and "end" not in done:
            await self.evaluations.at_edge("end")
        self.state.phase = "stopped" if self.state.stop_requested else "done"

    async def run_and_report(self, server: Any | None = None, run_logger: Any | None = None) -> None:
        """Run, write the report, close the experiment logs (after the report: they hold at least what it
        holds), then tell every service to stop (and the API server to exit)."""
        await self.run()
        await self.evaluations.save()
        wall = time.time() - self.state.started_at
        path = await asyncio.to_thread(write_report, self.state, self.evaluations.entries, self.cfg.run_dir(),
                                      wall)
        log.info("report written to %s", path)
        if run_logger is not None:
            await run_logger.close(self)
        await self.bus.publish(self.bus.streams.control, Control(command="stop", args={"reason": self.state.phase}))
        if server is not None:
            server.should_exit = True

    async def housekeeping(self, stop: asyncio.Event) -> None:
        """Every ``run.trim_interval_s`` (0: never): save new evaluation reports (on-demand ones), and
        trim what every consumer group has acknowledged."""
        s, cfg = self.bus.streams, self.cfg
        streams = [s.events, s.control, s.replies(self.name)] + [
            f(a) for a in cfg.agents for f in (s.turns, s.samples, s.batches, s.weights)]
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.run.trim_interval_s or 30.0)
            try:  # a Redis outage (or full disk) skips a round: the next one does it (common/reconnect.py)
                await self.evaluations.save()
                for name in streams if cfg.run.trim_interval_s else []:
                    await self.bus.trim_acknowledged(name)
                for agent in self.groups.ledger.agents:  # resolved groups past the staleness horizon (ledger.py prune)
                    await self.groups.ledger.prune(agent)
                await play_archive.prune_behind(self.bus.redis, s, self.episode_log.k_train_play, cfg.run_dir(),
                                                self.groups.ledger.horizons)
            except REDIS_DOWN as exc:
                log.warning("housekeeping skipped this round: %s", exc)
