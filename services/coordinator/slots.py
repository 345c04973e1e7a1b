"""The coordinator's episode slots (``run.concurrent_episodes``), shared between the training agents.

An episode holds one slot while it plays, charged in equal parts to the training agents whose engines play in
it (its ``AgentPlayer`` roles: a self-play episode half to each; scripted, frozen and in-process pool players
are charged nothing). Each training agent's share is ``ceil(concurrent_episodes / training agents)``. The
rule: while another training agent still has groups to play (to launch, or in flight), an agent's charge stays
within its share; an episode that would take an agent past it waits, even with slots free. Waiting episodes
take free slots first come, first served among those the rule lets in. Once the others have no groups left to
play, an agent may take every slot.

So slots stay reserved for an agent even while it waits for its own trainer (an on-policy agent between
steps), and episodes stuck on one agent's hung engine (they wait until their group's timeout) hold at most
that agent's share: the other agent's groups keep playing, where its episodes do not need the hung agent.
The price: an agent cannot borrow the other's idle slots to run further ahead (docs/architecture.md §4).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from fractions import Fraction

from services.contracts.players import AgentPlayer, Player


class EpisodeSlots:
    def __init__(self, total: int, agents: Iterable[str], playing: Callable[[str], bool]) -> None:
        """``agents``: the training agents; ``playing(agent)``: has it groups left to play."""
        self.total, self.agents, self.playing = total, frozenset(agents), playing
        self.share = max(1, -(-total // max(1, len(self.agents))))
        self.busy = 0
        self.held: dict[str, Fraction] = dict.fromkeys(self.agents, Fraction(0))  # agent -> its charge
        self.waiting: list[tuple[frozenset[str], asyncio.Future[None]]] = []  # first come, first in the list

    def charged(self, roles: dict[str, Player]) -> frozenset[str]:
        """The training agents whose engines play an episode with ``roles``: the ones its slot is charged to."""
        return frozenset(p.agent for p in roles.values() if isinstance(p, AgentPlayer) and p.agent in self.agents)

    def capped(self, agent: str) -> bool:
        """Is ``agent`` held to its share: another training agent has groups left to play."""
        return any(self.playing(other) for other in self.agents - {agent})

    def fits(self, agents: frozenset[str]) -> bool:
        """A free slot, and no capped agent taken past its share by this episode's part of it."""
        part = Fraction(1, len(agents)) if agents else Fraction(0)
        return self.busy < self.total and all(self.held[a] + part <= self.share or not self.capped(a)
                                              for a in agents)

    def take(self, agents: frozenset[str], sign: int = 1) -> None:
        self.busy += sign
        for a in agents:
            self.held[a] += sign * Fraction(1, len(agents))

    def release(self, agents: frozenset[str]) -> None:
        self.take(agents, -1)
        self.grant()

    def grant(self) -> None:
        """Free slots to the waiting episodes the rule lets in, first come first."""
        while (entry := next((w for w in self.waiting if w[1].done() or self.fits(w[0])), None)) is not None:
            self.waiting.remove(entry)
            agents, granted = entry
            if not granted.done():
                self.take(agents)
                granted.set_result(None)

    @asynccontextmanager
    async def hold(self, roles: dict[str, Player]) -> AsyncIterator[None]:
        """One slot for an episode with ``roles``, held while the block runs."""
        agents = self.charged(roles)
        if self.fits(agents) and not any(w[0] == agents for w in self.waiting):
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
