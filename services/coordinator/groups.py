"""Training groups: each launched into the ledger, played, its samples emitted, or abandoned.

A group's players are its matchup (``group_roles``: the same after a restart); a ``Pool`` player is
drawn per group (players.py). The group's G episodes share a seed (and, with ``scripted_rng:
group``, the scripted players' rng); each trained agent's samples go to its buffer in one ledger
transaction (ledger.py), and an agent with no turn in any episode has its part abandoned. A group
playing past ``run.group_timeout_s`` or 4 x the slowest recent one is abandoned; an agent with no
turn in ``MAX_EMPTY_GROUPS`` groups in a row stops the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.common.latency import LatencyWindow
from services.contracts.config import TandemConfig
from services.contracts.messages import new_id
from services.contracts.players import AgentPlayer, Player
from services.contracts.records import GroupState
from services.coordinator.episodes import EpisodeLog
from services.coordinator.ledger import GroupLedger
from services.coordinator.players import Players
from services.coordinator.state import RunState
from services.envs.base import Environment
from services.play.episode import EpisodeResult, group_samples, group_scripted_rng

log = logging.getLogger("tandem.coordinator")

MAX_EMPTY_GROUPS = 50


class GroupPlay:
    def __init__(self, cfg: TandemConfig, state: RunState, env_cls: type[Environment], players: Players,
                 episodes: EpisodeLog, ledger: GroupLedger, notify: Callable[[], Awaitable[None]]) -> None:
        self.cfg, self.state, self.env_cls, self.players = cfg, state, env_cls, players
        self.episodes, self.ledger, self.notify = episodes, ledger, notify
        self.seconds = LatencyWindow(size=32)  # how long groups took to play: the group timeout follows it
        self.empty_streak: dict[str, int] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def roles_for_group(self, index: int) -> dict[str, Player]:
        """Group ``index``'s players: matchups cycled (or roles), the same after a restart (``group_roles``)."""
        return self.cfg.environment.group_roles(index)

    def trained(self, roles: dict[str, Player]) -> set[str]:
        """The agents that train on a group played with ``roles``."""
        return {p.agent for p in roles.values() if isinstance(p, AgentPlayer) and p.agent in self.state.agents}

    async def launch(self, index: int, roles: dict[str, Player]) -> None:
        """Group ``index`` into the ledger, in flight for its agents, then played beside the run loop."""
        agents = self.trained(roles)
        group_id = f"g{index:06d}-{new_id()[:8]}"
        await self.ledger.launch(group_id, index, agents, *self.state.after_launch(index))
        for agent in agents:
            self.state.agents[agent].in_flight_groups += 1
        task = asyncio.create_task(self.run_group(index, roles, group_id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def finish(self, cancel: bool) -> None:
        """Wait for the groups still playing (cancelled first when the run stops: they end abandoned)."""
        for task in self.tasks if cancel else ():
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def play_group(self, index: int, roles: dict[str, Player], group_id: str) -> list[EpisodeResult]:
        seed, shared = self.cfg.run.seed * 1_000_003 + index, self.cfg.environment.scripted_rng == "group"
        envs = self.env_cls.make_group(self.cfg.environment.env_params(), seed, self.cfg.environment.group_size)
        sampling = self.players.sampling_for(roles)
        results = await asyncio.gather(*(self.episodes.play(e, group_id, roles, "train", sampling,
                                                            group_scripted_rng(seed) if shared else None)
                                         for e in envs))
        return [r for r in results if r is not None]

    async def run_group(self, index: int, roles: dict[str, Player], group_id: str) -> None:
        """Play one group and emit its samples; each agent's part ends in the ledger: emitted, or abandoned."""
        agents = self.trained(roles)
        roles = self.players.resolve_pool(roles)
        emitted: set[str] = set()
        timeout, started = self.seconds.bound(self.cfg.run.group_timeout_s), time.monotonic()
        try:
            done = await asyncio.wait_for(self.play_group(index, roles, group_id), timeout)
            self.seconds.add(time.monotonic() - started)
            counts = group_samples(done, agents)
            samples = [sample for r in done for sample in r.samples(counts)]
            empty = {a: "episode error: every episode of the group failed" if not done else "no turn in any episode"
                     for a in agents if not counts[a]}
            means = await self.ledger.emit(group_id, samples, empty)
            emitted = set(means)
            for agent, mean in means.items():
                self.state.agents[agent].group_rewards.append((time.time(), mean))
            for agent, reason in empty.items():
                self.state.agents[agent].resolve_group(group_id, GroupState.ABANDONED, reason)
        except TimeoutError:
            await self.abandon(group_id, agents, f"timeout: still playing after {timeout:g}s")
        except asyncio.CancelledError:
            await self.abandon(group_id, agents, "run stopped")
            raise
        except Exception as exc:
            log.exception("group %s failed", group_id)
            await self.abandon(group_id, agents, f"episode error: {exc!r}")
        finally:
            self.check_starved(agents, emitted)
            await self.notify()

    async def abandon(self, group_id: str, agents: set[str], reason: str) -> None:
        log.warning("group %s abandoned: %s", group_id, reason)
        try:
            await self.ledger.abandon(group_id, agents, reason)
        except Exception:  # Redis unreachable: the ledger keeps the group playing, which a restart abandons
            log.exception("cannot record group %s as abandoned", group_id)
        for agent in agents:
            self.state.agents[agent].resolve_group(group_id, GroupState.ABANDONED, reason)

    def check_starved(self, agents: set[str], emitted: set[str]) -> None:
        """Stop the run when an agent got no turn in MAX_EMPTY_GROUPS groups in a row: with these
        players the environment never lets it act (say, a counterpart whose replies never parse),
        and waiting for its batches would never end."""
        for agent in agents:
            streak = 0 if agent in emitted else self.empty_streak.get(agent, 0) + 1
            self.empty_streak[agent] = streak
            if streak >= MAX_EMPTY_GROUPS and not self.state.stop_requested:
                self.state.error = (f"agent {agent} had no turn in {streak} groups in a row: the environment "
                                    "never lets it act with these players; stopping the run")
                log.error(self.state.error)
                self.state.stop_requested = True
