"""The coordinator's episode slots (services/coordinator/slots.py): each training agent within its share while
another agent trains (even while that one waits for its trainer), a self-play episode charged half to each, and
every slot to an agent once the others have no group left to play.

Real ``EpisodeSlots`` on a real event loop; an episode stuck on a hung engine is one waiting on an event until
its group's timeout cancels it.
"""

from __future__ import annotations

import asyncio

from services.contracts.players import AgentPlayer, Scripted
from services.coordinator.slots import EpisodeSlots

A_VS_SCRIPT = {"X": AgentPlayer(agent="A"), "O": Scripted(name="minimax")}
B_VS_SCRIPT = {"X": Scripted(name="random"), "O": AgentPlayer(agent="B")}
A_VS_B = {"X": AgentPlayer(agent="A"), "O": AgentPlayer(agent="B")}
A_VS_FROZEN = {"X": AgentPlayer(agent="A"), "O": AgentPlayer(agent="C")}  # C plays but does not train


async def episode(slots: EpisodeSlots, roles: dict, until: asyncio.Event, played: list[str]) -> None:
    async with slots.hold(roles):
        await until.wait()
        played.append("".join(sorted(slots.charged(roles))))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_stuck_agent_holds_its_share_and_the_other_agent_plays_on() -> None:
    done: set[str] = set()  # the agents with no group left to play
    slots, played = EpisodeSlots(8, ["A", "B"], lambda a: a not in done), []
    hung, free = asyncio.Event(), asyncio.Event()
    free.set()
    b = [asyncio.create_task(episode(slots, B_VS_SCRIPT, hung, played)) for _ in range(12)]
    await settle()
    # A has nothing to play (its gate waits for its trainer): B still takes only its share, 4 of the 8
    assert (slots.share, slots.busy, slots.held["B"], len(slots.waiting)) == (4, 4, 4, 8)
    a = [asyncio.create_task(episode(slots, A_VS_SCRIPT, free, played)) for _ in range(8)]
    await settle()
    assert all(t.done() for t in a) and played == ["A"] * 8, (played, slots.held)  # through A's 4 slots
    assert (slots.busy, slots.held["A"], len(slots.waiting)) == (4, 0, 8)  # A's slots idle, kept for A
    for task in b[:2]:  # their group's timeout: B's next two take the slots
        task.cancel()
    await settle()
    assert (slots.busy, slots.held["B"], len(slots.waiting)) == (4, 4, 6)
    done.add("A")  # A has played its last group: B may take every slot, from the next one freed
    b[2].cancel()
    await settle()
    assert (slots.busy, slots.held["B"], len(slots.waiting)) == (8, 8, 1)
    hung.set()
    await asyncio.gather(*b, return_exceptions=True)
    assert (slots.busy, len(slots.waiting), played.count("B")) == (0, 0, 9)


async def test_self_play_fills_every_slot_and_mixed_episodes_count_for_both() -> None:
    slots, gate, played = EpisodeSlots(4, ["A", "B"], lambda _: True), asyncio.Event(), []
    mixed = [asyncio.create_task(episode(slots, A_VS_B, gate, played)) for _ in range(6)]
    await settle()
    assert (slots.busy, slots.held["A"], slots.held["B"], len(slots.waiting)) == (4, 2, 2, 2)  # half to each
    gate.set()
    await asyncio.gather(*mixed)
    gate.clear()
    a = [asyncio.create_task(episode(slots, A_VS_FROZEN, gate, played)) for _ in range(3)]
    await settle()
    assert (slots.busy, slots.held["A"], len(slots.waiting)) == (2, 2, 1)  # C trains not: A's alone
    more = [asyncio.create_task(episode(slots, A_VS_B, gate, played)) for _ in range(2)]
    await settle()
    assert (slots.busy, len(slots.waiting)) == (2, 3)  # a self-play episode would take A past its share
    a[0].cancel()
    await settle()
    assert (slots.busy, slots.held["A"], len(slots.waiting)) == (2, 2, 2)  # first come: A's third one
    a[1].cancel()  # A's part of one slot free: both self-play episodes fit in it (half of each is A's)
    await settle()
    assert (slots.busy, slots.held["A"], slots.held["B"], len(slots.waiting)) == (3, 2, 1, 0)
    gate.set()
    await asyncio.gather(*a, *more, return_exceptions=True)
    assert played.count("AB") == 8 and played.count("A") == 1
    assert slots.busy == 0 and not slots.waiting and not any(slots.held.values())
