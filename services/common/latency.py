"""Timeouts that follow measured latency: a window of recent durations and a bound with a floor.

A timeout set once is either too short for a slow model (work still running is taken for lost and done
again) or too long for a fast one (a lost piece of work waits for nothing). ``LatencyWindow`` keeps the
last durations of one kind of work; ``bound(floor)`` is ``factor`` times the slowest of them, never below
``floor`` (the configured value: the timeout before anything was measured) nor above ``cap``.
"""

from __future__ import annotations

from collections import deque


class LatencyWindow:
    """The last ``size`` durations (seconds) of one kind of work."""

    def __init__(self, size: int = 64, factor: float = 4.0) -> None:
        if size < 1 or factor < 1:
            raise ValueError("a latency window needs size >= 1 and factor >= 1")
        self._seconds: deque[float] = deque(maxlen=size)
        self.factor = factor

    def add(self, seconds: float) -> None:
        if seconds >= 0:
            self._seconds.append(float(seconds))

    def __len__(self) -> int:
        return len(self._seconds)

    def slowest(self) -> float:
        return max(self._seconds, default=0.0)

    def bound(self, floor: float, cap: float | None = None) -> float:
        """``factor`` x the slowest recent duration, at least ``floor``, at most ``cap`` (when given)."""
        value = max(floor, self.factor * self.slowest())
        return min(value, cap) if cap is not None else value
