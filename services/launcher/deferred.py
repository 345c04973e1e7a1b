"""Services the first turn does not need, started once it is played (docs/architecture.md §9, Start-up).

On a small machine every process that starts with the engines takes CPU from them, and the first turn
waits on the engines alone. The buffers and trainers are needed only once a group is played, so under
``tandem up`` (a new or ``--fresh`` run) the launcher starts them when the first entry lands on any of
the run's turns streams, or after ``FIRST_TURN_WAIT_S`` at the latest (no turn: they start anyway and
say what is wrong). Nothing is lost meanwhile: their consumer groups read their streams from the start.
A resumed run starts everything at once (its coordinator may be waiting on a trainer), as do restarts.
"""

from __future__ import annotations

import logging
import threading
import time

import redis as redis_lib

log = logging.getLogger("tandem.launcher")

FIRST_TURN_WAIT_S = 60.0
BLOCK_MS = 500


class AfterFirstTurn:
    """Holds (name, command) pairs until the first turn; a thread watches the turns streams."""

    def __init__(self, redis_url: str, turn_streams: list[str], wait_s: float = FIRST_TURN_WAIT_S) -> None:
        self.pending: list[tuple[str, list[str]]] = []
        self.due = threading.Event()
        self._url, self._streams, self._wait_s = redis_url, turn_streams, wait_s
        self._thread = threading.Thread(target=self._watch, name="after-first-turn", daemon=True)

    def add(self, name: str, cmd: list[str]) -> None:
        self.pending.append((name, cmd))

    def watch(self) -> AfterFirstTurn:
        self._thread.start()
        return self

    def take_due(self) -> list[tuple[str, list[str]]]:
        """The held services once the first turn is played (or the wait is over); none before, or twice."""
        if not self.due.is_set():
            return []
        due, self.pending = self.pending, []
        return due

    def _watch(self) -> None:
        deadline = time.monotonic() + self._wait_s
        client = redis_lib.Redis.from_url(self._url, socket_timeout=BLOCK_MS / 1000 + 5)
        try:
            while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
                try:  # from id 0: an entry already there answers at once, else Redis wakes us on the first one
                    if client.xread(dict.fromkeys(self._streams, "0"), count=1, block=min(left_ms, BLOCK_MS)):
                        return
                except (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError):
                    time.sleep(0.2)  # Redis starting or restarting: the wait goes on
            log.warning("no turn after %.0fs; starting the buffers and trainers anyway", self._wait_s)
        finally:
            self.due.set()
            client.close()
