"""The coordinator's episode slots (services/coordinator/slots.py): each agent's share while another agent's
episodes wait, every slot to an agent alone with work, and a stuck agent's episodes kept to their share.

Real ``EpisodeSlots`` on a real event loop; an episode stuck on a hung engine is one waiting on an event until
its group's timeout cancels it.
"""

from __future__ import annotations

import asyncio

from services.contracts.players import AgentPlayer, Scripted
from services.coordinator.slots import EpisodeSlots, engine_agents

A_VS_SCRIPT = {"X": AgentPlayer(agent="A"), "O": Scripted(name="minimax")}
B_VS_SCRIPT = {"X": Scripted(name="random"), "O": AgentPlayer(agent="B")}
A_VS_B = {"X": AgentPlayer(agent="A"), "O": AgentPlayer(agent="B")}


async def episode(slots: EpisodeSlots, roles: dict, until: asyncio.Event, played: list[str]) -> None:
    async with slots.hold(roles):
        await until.wait()
        played.append(",".join(sorted(engine_agents(roles))))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_stuck_agent_keeps_its_share_and_the_other_agent_plays_on() -> None:
    slots, hung, free, played = EpisodeSlots(8, ["A", "B"]), asyncio.Event(), asyncio.Event(), []
    free.set()
    b = [asyncio.create_task(episode(slots, B_VS_SCRIPT, hung, played)) for _ in range(12)]
    await settle()
    assert (slots.busy, slots.held["B"], len(slots.waiting)) == (8, 8, 4)  # alone with work: every slot
    a = [asyncio.create_task(episode(slots, A_VS_SCRIPT, free, played)) for _ in range(8)]
    await settle()
    assert played == [] and len(slots.waiting) == 12  # B's stuck episodes hold every slot
    for task in b[:2]:  # their group's timeout: two slots free, and they go to A (B holds 6, over its share 4)
        task.cancel()
    await settle()
    assert all(t.done() for t in a) and played == ["A"] * 8, (played, slots.held)
    # with A done, the freed slots go to B's waiting episodes: no slot idles while anyone waits
    assert (slots.busy, slots.held["B"], slots.held["A"], len(slots.waiting)) == (8, 8, 0, 2)
    hung.set()
    await asyncio.gather(*b, return_exceptions=True)
    assert (slots.busy, len(slots.waiting), played.count("B")) == (0, 0, 10)


async def test_each_agent_gets_back_to_its_share_and_a_two_agent_episode_counts_for_both() -> None:
    slots, gate, played = EpisodeSlots(4, ["A", "B"]), asyncio.Event(), []
    held = lambda: (slots.held["A"], slots.held["B"])  # noqa: E731
    a = [asyncio.create_task(episode(slots, A_VS_SCRIPT, gate, played)) for _ in range(6)]
    await settle()
    mixed = asyncio.create_task(episode(slots, A_VS_B, gate, played))
    b = [asyncio.create_task(episode(slots, B_VS_SCRIPT, gate, played)) for _ in range(3)]
    await settle()
    assert (slots.share, held(), len(slots.waiting)) == (2, (4, 0), 6)  # waiting: A, A, A-vs-B, B, B, B
    a[0].cancel()  # A holds 3, over its share: the slot goes to B's first (A's and the A-vs-B one wait)
    await settle()
    assert held() == (3, 1)
    a[1].cancel()
    await settle()
    assert held() == (2, 2)  # B's second
    a[2].cancel()
    await settle()
    assert held() == (2, 2) and not a[4].done() and len(slots.waiting) == 3  # A below its share: A's next (a[4])
    b[0].cancel()
    await settle()
    assert held() == (2, 2) and len(slots.waiting) == 2  # B's third; the A-vs-B episode needs both below
    a[3].cancel()
    await settle()
    assert held() == (2, 2) and len(slots.waiting) == 1  # A's last (a[5]) before it, first come first served
    a[4].cancel()  # B at its share, nobody else waits: the A-vs-B episode takes the slot, counted for both
    await settle()
    assert held() == (2, 3) and slots.busy == 4 and not slots.waiting
    gate.set()
    await asyncio.gather(*a, *b, mixed, return_exceptions=True)
    assert sorted(played) == ["A", "A,B", "B", "B"] and slots.busy == 0 and not slots.waiting and not +slots.held
