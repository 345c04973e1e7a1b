"""A plug-in environment defined outside services/, loaded by ``plugin_env:CountUp`` (tests put tests/ on the path).

Two roles take turns saying the next number; a reply that is not the next number
scores -1 for that role and ends the game, reaching ``target`` scores +1 for both.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from pydantic import Field

from services.envs.base import Environment, EnvParams, StepResult


class CountUpParams(EnvParams):
    target: int = Field(3, ge=1, le=9, description="the number that ends the game")


class CountUp(Environment[CountUpParams]):
    roles: ClassVar[tuple[str, ...]] = ("left", "right")
    description: ClassVar[str] = "Say the next number in turn; a wrong number loses."
    scripted_players: ClassVar[tuple[str, ...]] = ("counter",)

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        self.n = 0
        self.turn = 0

    def current_role(self) -> str:
        return self.roles[self.turn % 2]

    def observation(self, role: str) -> str:
        return f"{self.n}"

    async def step(self, role: str, reply: str) -> StepResult:
        self.turn += 1
        m = re.match(r"\s*(\d+)", reply)
        if m is None or int(m.group(1)) != self.n + 1:
            other = self.roles[self.turn % 2]
            return StepResult(done=True, rewards={role: -1.0, other: 0.0})
        self.n += 1
        if self.n >= self.params.target:
            return StepResult(done=True, rewards={r: 1.0 for r in self.roles})
        return StepResult(done=False)

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        return str(self.n + 1)
