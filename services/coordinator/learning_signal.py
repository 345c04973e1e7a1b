"""Whether each agent's training has a learning signal, per step, and the run's reaction when it has none.

Each ``train_step`` carries the batch's ``zero_variance_groups`` (the share of its groups whose rewards were all
equal: under a group baseline every advantage is 0, the step teaches nothing) and ``malformed_rate`` (the share
of its samples with an illegal or malformed reply), from ``services/training/signal.py``. A step with
``zero_variance_groups`` of 1 had no learning signal: the first of a streak is warned of (naming the malformed
rate, the usual cause with a real model: replies that never parse all earn the same penalty);
``agents.<X>.max_no_signal_steps`` such steps in a row stop the run with that message as its error (the
coordinator then exits non-zero: ``RUN_FAILED``). The streak is read off the train steps themselves, so a
restarted coordinator sees it as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from services.contracts.config import TandemConfig

log = logging.getLogger("tandem.coordinator")


class _Agent(Protocol):
    train_steps: list[dict[str, Any]]


class _State(Protocol):
    agents: dict[str, Any]
    error: str | None
    stop_requested: bool


def no_signal(step: dict[str, Any]) -> bool:
    """The step trained on a batch whose every group had equal rewards."""
    share = step.get("zero_variance_groups")
    return isinstance(share, int | float) and share >= 1.0


def no_signal_streak(steps: Sequence[dict[str, Any]]) -> int:
    """How many of the newest steps in a row had no learning signal."""
    streak = 0
    for step in reversed(steps):
        if not no_signal(step):
            break
        streak += 1
    return streak


def signal_status(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """An agent's learning signal for ``/v1/status`` and ``summary.json``: the last step's zero-variance share
    and malformed rate (None before a step), and the steps in a row without signal."""
    last = steps[-1] if steps else {}
    return {"zero_variance_groups": last.get("zero_variance_groups"), "malformed_rate": last.get("malformed_rate"),
            "no_signal_steps": no_signal_streak(steps)}


class SignalWatch:
    """Warns of an agent's step without learning signal and stops the run after too many in a row."""

    def __init__(self, cfg: TandemConfig) -> None:
        self.limits = {a: c.max_no_signal_steps for a, c in cfg.agents.items()}
        self.warned: set[tuple[str, int]] = set()  # (agent, first version of a streak) already warned of

    def check(self, state: _State, agent: str) -> None:
        """After ``agent``'s newest train step: warn at the start of a streak, stop the run at the limit."""
        steps = state.agents[agent].train_steps
        streak = no_signal_streak(steps)
        if not streak:
            return
        last = steps[-1]
        start = int(steps[-streak].get("weight_version", 0))
        malformed = last.get("malformed_rate")
        why = (f"{malformed:.0%} of its samples had a malformed or illegal reply" if isinstance(malformed, float)
               else "its malformed rate is unknown")
        if (agent, start) not in self.warned:
            self.warned.add((agent, start))
            log.warning("agent %s: step %s had no learning signal: every group's rewards were equal (zero "
                        "variance), so every advantage was 0; %s", agent, last.get("weight_version"), why)
        limit = self.limits.get(agent, 0)
        if limit and streak >= limit and not state.stop_requested:
            state.error = (f"agent {agent} had no learning signal in {streak} training steps in a row (every group's "
                           f"rewards were equal; in the last step {why}): the run learns nothing, so it stops "
                           f"(agents.{agent}.max_no_signal_steps={limit}). Check that the replies parse: the "
                           "transcripts, the environment's system messages (environment.params.system), "
                           "sampling.max_new_tokens")
            log.error(state.error)
            state.stop_requested = True
