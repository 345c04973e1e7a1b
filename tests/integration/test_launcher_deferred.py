"""``tandem up`` starts a new run's buffers and trainers once the first turn is played (docs/architecture.md §9,
services/launcher/deferred.py): on the real Redis, nothing is due before an entry lands on a turns stream, all is
due after it (once), a run whose turns are already there is due at once, and past the wait they start anyway."""

from __future__ import annotations

import time

import redis as redis_lib

from services.contracts.streams import Streams
from services.launcher.deferred import AfterFirstTurn


def _held(redis_url: str, run: str, wait_s: float = 30.0) -> AfterFirstTurn:
    later = AfterFirstTurn(redis_url, [Streams(run).turns(a) for a in ("A", "B")], wait_s=wait_s)
    later.add("buffer.A", ["python", "-m", "services.buffer"])
    later.add("trainer.A", ["python", "-m", "services.trainer"])
    return later


def test_held_until_the_first_turn_then_due_once(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    client.delete(Streams("held").turns("A"), Streams("held").turns("B"))
    later = _held(redis_url, "held").watch()
    time.sleep(0.8)
    assert later.take_due() == [] and len(later.pending) == 2  # no turn yet: nothing starts
    client.xadd(Streams("held").turns("B"), {b"m": b"turn"})  # any agent's first turn
    assert later.due.wait(5)
    assert [name for name, _ in later.take_due()] == ["buffer.A", "trainer.A"]
    assert later.take_due() == [] and later.pending == []  # never twice
    client.delete(Streams("held").turns("B"))
    client.close()


def test_turns_already_there_are_due_at_once(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    client.xadd(Streams("there").turns("A"), {b"m": b"turn"})
    started = time.monotonic()
    later = _held(redis_url, "there").watch()
    assert later.due.wait(5) and time.monotonic() - started < 2
    assert len(later.take_due()) == 2
    client.delete(Streams("there").turns("A"))
    client.close()


def test_past_the_wait_they_start_anyway(redis_url: str) -> None:
    started = time.monotonic()
    later = _held(redis_url, "never", wait_s=0.5).watch()
    assert later.due.wait(5) and time.monotonic() - started >= 0.5
    assert len(later.take_due()) == 2


def test_a_redis_that_does_not_answer_yet_delays_nothing_past_the_wait() -> None:
    later = _held("redis://127.0.0.1:9/0", "down", wait_s=0.6).watch()  # nothing listens on port 9
    assert later.due.wait(10) and len(later.take_due()) == 2
