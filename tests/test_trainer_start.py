"""Under ``tandem up`` a trainer loads its model only after its agent's first turn (docs/architecture.md §9):
``after_first_turn`` waits on the real Redis for the turns stream's first entry, and not at all otherwise."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis.asyncio as aioredis

from services.contracts.config import TRAINER_AFTER_FIRST_TURN_ENV, parse_config
from services.contracts.streams import Streams
from services.trainer import __main__ as trainer_main


def config(redis_url: str):  # type: ignore[no-untyped-def]
    return parse_config({"run": {"name": "first-turn"}, "redis_url": redis_url,
                         "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                         "agents": {"A": {"model_path": "m"}}})


async def test_the_trainer_waits_for_its_agents_first_turn(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, log = config(redis_url), logging.getLogger("test")
    client = aioredis.from_url(redis_url)
    stream = Streams("first-turn").turns("A")
    await client.delete(stream)
    monkeypatch.setenv(TRAINER_AFTER_FIRST_TURN_ENV, "1")
    waiting = asyncio.create_task(trainer_main.after_first_turn(cfg, "A", log))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # no turn yet
    await client.xadd(stream, {b"m": b"turn"})
    await asyncio.wait_for(waiting, 5)
    await client.delete(stream)
    await client.aclose()


async def test_without_the_launchers_word_or_past_the_limit_it_starts(redis_url: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, log = config(redis_url), logging.getLogger("test")
    monkeypatch.delenv(TRAINER_AFTER_FIRST_TURN_ENV, raising=False)
    await asyncio.wait_for(trainer_main.after_first_turn(cfg, "A", log), 1)  # not under tandem up: no wait
    monkeypatch.setenv(TRAINER_AFTER_FIRST_TURN_ENV, "1")
    monkeypatch.setattr(trainer_main, "FIRST_TURN_WAIT_S", 0.3)
    started = time.monotonic()
    await asyncio.wait_for(trainer_main.after_first_turn(cfg, "A", log), 5)  # no turn ever: it gives up
    assert time.monotonic() - started >= 0.3
