"""Guess the number: one role against a programmatic answerer (DESIGN §8, Tinker cookbook pattern).

The guesser must find a hidden integer in [low, high] (drawn from the seed, so
the G copies of a group share it). Each reply must be an integer; the answerer
says "too low", "too high" or ends the episode when it is right.

Rewards (role ``guesser``)
* +1 when the number is found (final);
* ``-turn_cost`` per guess (per-turn reward), so fewer guesses score more;
* ``-format_penalty`` per reply that is not an integer in range; the episode
  goes on (the reply costs a turn).
After ``max_turns`` replies without finding it the episode ends with no bonus.

Scripted players: ``bisect`` (binary search: optimal) and ``random``.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from services.envs.base import Environment, EnvParamError, StepResult
from services.envs.params import check

NUMBER = re.compile(r"^\s*(-?\d+)\s*\.?\s*$")


class GuessNumber(Environment):
    roles: ClassVar[tuple[str, ...]] = ("guesser",)
    description: ClassVar[str] = ("Guess a hidden integer; the answerer says too high/too low. +1 found, "
                                  "-turn_cost per guess, -format_penalty per non-integer reply.")
    scripted_players: ClassVar[tuple[str, ...]] = ("bisect", "random")

    def __init__(self, params: dict[str, Any], seed: int) -> None:
        super().__init__(params, seed)
        p = self.params
        self.low, self.high = p["low"], p["high"]
        self.target = self.rng.randint(self.low, self.high)
        self.lo, self.hi = self.low, self.high  # what the answers so far allow
        self.turns = 0
        self.feedback = f"Guess my number, {self.low}-{self.high}."
        self.found = False
        self.malformed = 0

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        p = check("guess_number", params, {
            "low": (int, 1, None, None), "high": (int, 16, None, None), "max_turns": (int, 6, 1, 100),
            "turn_cost": (float, 0.05, 0.0, 1.0), "format_penalty": (float, 0.2, 0.0, 10.0)})
        if p["high"] <= p["low"]:
            raise EnvParamError(f"guess_number: high must be greater than low, got low={p['low']} high={p['high']}")
        return p

    def current_role(self) -> str:
        return "guesser"

    def observation(self, role: str) -> str:
        return self.feedback

    async def step(self, role: str, reply: str) -> StepResult:
        self.turns += 1
        m = NUMBER.match(reply)
        turn = {"guesser": -self.params["turn_cost"]}
        if m is None or not self.low <= int(m.group(1)) <= self.high:
            self.malformed += 1
            turn["guesser"] -= self.params["format_penalty"]
            self.feedback = f"Reply with one integer, {self.low}-{self.high}."
            info: dict[str, Any] = {"malformed": reply[:40]}
        else:
            guess = int(m.group(1))
            info = {"guess": guess}
            if guess == self.target:
                self.found = True
                return StepResult(done=True, rewards={"guesser": 1.0}, turn_rewards=turn, info=info)
            if guess < self.target:
                self.lo = max(self.lo, guess + 1)
                self.feedback = f"{guess} is too low."
            else:
                self.hi = min(self.hi, guess - 1)
                self.feedback = f"{guess} is too high."
        if self.turns >= self.params["max_turns"]:
            return StepResult(done=True, rewards={"guesser": 0.0}, turn_rewards=turn, info=info)
        return StepResult(done=False, turn_rewards=turn, info=info)

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if player == "bisect":
            return str((self.lo + self.hi) // 2)
        if player == "random":
            return str(rng.randint(self.lo, self.hi))
        raise ValueError(f"unknown scripted player {player!r}; choose from {self.scripted_players}")

    def summary(self) -> dict[str, Any]:
        return {"target": self.target, "found": self.found, "turns": self.turns, "malformed": self.malformed}
