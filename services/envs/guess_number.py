"""Guess the number: one role against a programmatic answerer (docs/architecture.md §8, Tinker cookbook pattern).

The guesser must find a hidden integer in [low, high] (drawn from the seed, so
the G copies of a group share it). A reply's guess is its last integer ("My guess is 50." counts); the
answerer says "too low", "too high" or ends the episode when it is right. The guesser's default system
message tells a chat model the game (``params.system`` replaces it; the demo model plays without one).

Rewards (role ``guesser``)
* +1 when the number is found (final);
* ``-turn_cost`` per guess (per-turn reward), so fewer guesses score more;
* ``-format_penalty`` per reply with no integer, or whose last integer is out of range; the episode
  goes on (the reply costs a turn).
* ``-info_shaping`` x the guess's shortfall in expected information (``bits_shortfall``), a shaping
  term, off by default: the bits a best guess (a midpoint of the range the answers allow) is expected
  to learn, minus those this guess is expected to learn, the hidden number taken as uniform over that
  range. Binary search's guesses pay 0, a guess at an end of a wide range about 1 bit, a guess the
  answers already exclude, or a malformed reply, the whole of a best guess's bits (so that shaping
  never makes a malformed reply the cheaper miss). It depends only on the guess and the range,
  not on the hidden number, so it tells a guess's worth with no luck in it; the true score stays the
  number of guesses.
After ``max_turns`` replies without finding it the episode ends with no bonus.
With ``show_range`` the feedback also states the range the answers so far allow
("50 is too low; 51-100."), so a small model need not track it over the whole history; with
``pad_range`` too, both ends are zero-padded to the width of ``high`` ("50 is too low; 051-100."):
each digit of the range then sits at a fixed distance from the end of the observation, which a
tiny byte-level model reads far more easily. Both default off (the plain feedback).

Scripted players: ``bisect`` (binary search: optimal) and ``random``.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator

from services.envs.base import Environment, StepResult
from services.envs.params import SHAPING, ChatParams, EnvParams

INTEGER = re.compile(r"(?<!\w)-?\d+|\d+")  # a minus sign only where it starts a number: "1-16" is 1 and 16


def last_int(reply: str) -> int | None:
    """The last integer of a reply, or None when it has none."""
    found = INTEGER.findall(reply)
    return int(found[-1]) if found else None


class GuessNumberParams(ChatParams):
    low: int = Field(1, description="smallest number")
    high: int = Field(16, description="largest number (greater than low)")
    max_turns: int = Field(6, ge=1, le=100)
    turn_cost: float = Field(0.05, ge=0.0, le=1.0, description="per guess")
    format_penalty: float = Field(0.2, ge=0.0, le=10.0, description="per reply that is not an integer in range")
    info_shaping: float = Field(0.0, ge=0.0, le=10.0, json_schema_extra=SHAPING,
                                description="shaping, per bit: each in-range guess pays -info_shaping x its "
                                "shortfall in expected information from a midpoint guess's (bits_shortfall); 0: off")
    show_range: bool = Field(False, description="the feedback also states the range the answers so far allow")
    pad_range: bool = Field(False, description="with show_range: both ends of the range zero-padded to the "
                            "width of high (51-100 -> 051-100)")

    @field_validator("high")
    @classmethod
    def _above_low(cls, high: int, info: ValidationInfo) -> int:
        low = info.data.get("low")
        if low is not None and high <= low:
            raise ValueError(f"must be greater than low ({low})")
        return high


def expected_bits(lo: int, hi: int, guess: int) -> float:
    """The information (bits) a guess is expected to give when the hidden number is uniform on [lo, hi]:
    the entropy of the answer (too low, too high, found); 0 for a guess outside [lo, hi] (its answer is
    known) or an empty range."""
    width = hi - lo + 1
    if width < 1 or not lo <= guess <= hi:
        return 0.0
    counts = (guess - lo, 1, hi - guess)
    return -sum(c / width * math.log2(c / width) for c in counts if c)


def bits_shortfall(lo: int, hi: int, guess: int) -> float:
    """How many bits less than a midpoint guess of [lo, hi] ``guess`` is expected to give (>= 0; 0 at a midpoint)."""
    if hi < lo:
        return 0.0
    best = expected_bits(lo, hi, (lo + hi) // 2)
    return max(best - expected_bits(lo, hi, guess), 0.0)


class GuessNumber(Environment[GuessNumberParams]):
    roles: ClassVar[tuple[str, ...]] = ("guesser",)
    description: ClassVar[str] = ("Guess a hidden integer; the answerer says too high/too low. +1 found, "
                                  "-turn_cost per guess, -format_penalty per non-integer reply, optional "
                                  "shaping -info_shaping per bit a guess is expected to learn less than a "
                                  "midpoint guess.")
    scripted_players: ClassVar[tuple[str, ...]] = ("bisect", "random")
    env_name: ClassVar[str] = "guess_number"
    summary_measures: ClassVar[tuple[str, ...] | None] = ("found", "turns", "malformed")  # not the target

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        self.low, self.high = self.params.low, self.params.high
        self.target = self.rng.randint(self.low, self.high)
        self.lo, self.hi = self.low, self.high  # what the answers so far allow
        self.turns = 0
        self.feedback = f"Guess my number, {self.low}-{self.high}."
        self.found = False
        self.malformed = 0

    def current_role(self) -> str:
        return "guesser"

    def observation(self, role: str) -> str:
        return self.feedback

    def default_system_prompt(self, role: str) -> str:
        """The game told to a chat model, with this episode's range."""
        return (f"We play a guessing game. I am thinking of an integer from {self.low} to {self.high}. "
                "Guess it. After each guess I say whether your guess is too low or too high. Reply with only "
                "your guess: one integer, nothing else.")

    async def step(self, role: str, reply: str) -> StepResult:
        self.turns += 1
        value = last_int(reply)
        turn = {"guesser": -self.params.turn_cost}
        if value is None or not self.low <= value <= self.high:
            self.malformed += 1
            turn["guesser"] -= self.params.format_penalty + self.params.info_shaping * self.best_bits()
            self.feedback = f"Reply with one integer, {self.low}-{self.high}."
            info: dict[str, Any] = {"malformed": reply[:40]}
        else:
            guess = value
            info = {"guess": guess}
            if self.params.info_shaping:
                turn["guesser"] -= self.params.info_shaping * bits_shortfall(self.lo, self.hi, guess)
            if guess == self.target:
                self.found = True
                return StepResult(done=True, rewards={"guesser": 1.0}, turn_rewards=turn, info=info)
            if guess < self.target:
                self.lo = max(self.lo, guess + 1)
                self.feedback = f"{guess} is too low"
            else:
                self.hi = min(self.hi, guess - 1)
                self.feedback = f"{guess} is too high"
            self.feedback += f"; {self.range_text()}." if self.params.show_range else "."
        if self.turns >= self.params.max_turns:
            return StepResult(done=True, rewards={"guesser": 0.0}, turn_rewards=turn, info=info)
        return StepResult(done=False, turn_rewards=turn, info=info)

    def best_bits(self) -> float:
        """The bits a midpoint guess of the range left is expected to learn: what a malformed reply forgoes."""
        return expected_bits(self.lo, self.hi, (self.lo + self.hi) // 2)

    def range_text(self) -> str:
        """The range the answers so far allow, as the feedback states it ("51-100", "051-100" padded)."""
        width = len(str(self.high)) if self.params.pad_range else 0
        return f"{self.lo:0{width}d}-{self.hi:0{width}d}"

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if player == "bisect":
            return str((self.lo + self.hi) // 2)
        if player == "random":
            return str(rng.randint(self.lo, self.hi))
        raise ValueError(f"unknown scripted player {player!r}; choose from {self.scripted_players}")

    def summary(self) -> dict[str, Any]:
        return {"target": self.target, "found": self.found, "turns": self.turns, "malformed": self.malformed}
