"""Steps per minute and the run's ETA for the terminal live view, from the statuses it polls.

Each agent's step count is sampled with the time it was seen; the rate is taken over the last
``WINDOW_S`` seconds of samples (the whole history until a window's worth exists), so start-up and
the opening evaluation do not drag it down for long. The run's ETA is the slowest agent's.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

WINDOW_S = 300.0


class Progress:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.seen: dict[str, deque[tuple[float, int]]] = {}

    def update(self, status: dict[str, Any] | None, now: float | None = None) -> None:
        if not status:
            return
        now = time.time() if now is None else now
        for name, a in status.get("agents", {}).items():
            hist = self.seen.setdefault(name, deque())
            if not hist or hist[-1][1] != a["step"]:
                hist.append((now, int(a["step"])))
            while len(hist) > 2 and now - hist[1][0] > self.window_s:
                hist.popleft()

    def steps_per_min(self, agent: str) -> float | None:
        """Steps per minute between the first and the last step change in the window (None before two)."""
        hist = self.seen.get(agent)
        if not hist or len(hist) < 2 or hist[-1][0] <= hist[0][0]:
            return None
        return (hist[-1][1] - hist[0][1]) * 60.0 / (hist[-1][0] - hist[0][0])

    def eta_s(self, agent: str, step: int, total: int, now: float | None = None) -> float | None:
        """Seconds until ``total`` steps at the current rate (0 when done, None while unknown)."""
        if step >= total:
            return 0.0
        rate = self.steps_per_min(agent)
        if not rate:
            return None
        now = time.time() if now is None else now
        since_last = now - self.seen[agent][-1][0]
        return max(0.0, (total - step) * 60.0 / rate - since_last)

    def run_eta_s(self, status: dict[str, Any]) -> float | None:
        etas = [self.eta_s(n, a["step"], status["total_steps"]) for n, a in status.get("agents", {}).items()]
        return None if not etas or any(e is None for e in etas) else max(e for e in etas if e is not None)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
