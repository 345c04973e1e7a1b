"""The coordinator's episode slots (``run.concurrent_episodes``), shared between the agents.

An episode holds one slot while it plays, charged to every agent whose engines play in it (its
``AgentPlayer`` roles; scripted and in-process players need no engine). Each agent's share is
``ceil(concurrent_episodes / agents)``. The rule: a free slot goes to the first waiting episode whose
agents all hold less than their share; when every waiting episode has an agent at its share, to the first
waiting one, so a slot that no other agent wants is never left idle. An agent alone with work takes
every slot; while another agent's episodes wait, each agent's episodes get back to their share as
slots free. So episodes stuck on one agent's hung engine (they wait until their group's timeout) hold
at most that agent's share once the other agent has work, and the other agent's groups keep playing
where its episodes do not need the hung agent (docs/architecture.md §4).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from services.contracts.players import AgentPlayer, Player


def engine_agents(roles: dict[str, Player]) -> frozenset[str]:
    """The agents whose engines play an episode with ``roles``: the ones its slot is charged to."""
    return frozenset(p.agent for p in roles.values() if isinstance(p, AgentPlayer))


class EpisodeSlots:
    def __init__(self, total: int, agents: Iterable[str]) -> None:
        self.total = total
        self.share = max(1, -(-total // max(1, len(set(agents)))))
        self.busy = 0
        self.held: Counter[str] = Counter()  # agent -> slots its episodes hold
        self.waiting: list[tuple[frozenset[str], asyncio.Future[None]]] = []  # first come, first in the list

    def under_share(self, agents: frozenset[str]) -> bool:
        return all(self.held[a] < self.share for a in agents)

    def take(self, agents: frozenset[str]) -> None:
        self.busy += 1
        self.held.update(agents)

    def release(self, agents: frozenset[str]) -> None:
        self.busy -= 1
        self.held.subtract(agents)
        self.grant()

    def grant(self) -> None:
        """Free slots to waiting episodes: the first under its agents' share, else the first."""
        while self.busy < self.total and self.waiting:
            entry = next((w for w in self.waiting if self.under_share(w[0])), self.waiting[0])
            self.waiting.remove(entry)
            agents, granted = entry
            if not granted.done():
                self.take(agents)
                granted.set_result(None)

    @asynccontextmanager
    async def hold(self, roles: dict[str, Player]) -> AsyncIterator[None]:
        """One slot for an episode with ``roles``, held while the block runs."""
        agents = engine_agents(roles)
        if self.busy < self.total and not self.waiting:
            self.take(agents)
        else:
            entry = (agents, asyncio.get_running_loop().create_future())
            self.waiting.append(entry)
            try:
                await entry[1]
            except asyncio.CancelledError:
                if entry[1].done() and not entry[1].cancelled():  # granted, then cancelled: handed on
                    self.release(agents)
                elif entry in self.waiting:
                    self.waiting.remove(entry)
                raise
        try:
            yield
        finally:
            self.release(agents)
