"""Tasks with checkable answers, played single-agent or as solver and critic (math, code).

A task (``Task``) has a prompt and a grader: ``grade(reply)`` gives a score in
[0, 1], or None when the reply cannot be parsed at all.

``SolveEnv`` (role ``solver``): one reply, reward = its score, or
``-format_penalty`` when unparseable.

``SolveCriticEnv`` (roles ``solver`` and ``critic``): the solver answers; the
critic sees the task and the answer and replies ``CORRECT`` or ``WRONG`` (the
first such word counts), optionally with a hint; when ``revise`` is on, the
solver sees the critique and answers again, and its final answer is graded.
* solver: the final answer's score (``-format_penalty`` if unparseable);
* critic: +1 when its verdict is right about the first answer (CORRECT iff
  its score is 1), -1 when wrong, ``-format_penalty`` when it gives no verdict
  (the solver is then shown "(no verdict)" and the episode goes on).

Each task family's ``default_system`` tells a chat model, per role, the form of its reply.

Scripted players: solver ``oracle`` (the reference answer) and ``wrong``;
critic ``oracle`` (always right), ``yes`` (always CORRECT).
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from pydantic import Field, create_model

from services.envs.base import Environment, StepResult
from services.envs.params import ChatParams, EnvParams

VERDICT = re.compile(r"\b(correct|wrong)\b", re.IGNORECASE)


@dataclass
class Task(ABC):
    prompt: str
    reference: str  # a reply that scores 1
    wrong: str  # a parseable reply that scores 0

    @abstractmethod
    def grade(self, reply: str) -> float | None:
        """The reply's score in [0, 1]; None when it cannot be parsed."""


class VerifiableParams(ChatParams):
    format_penalty: float = Field(0.5, ge=0.0, le=10.0, description="per unparseable reply")


class CriticParams(EnvParams):
    revise: bool = Field(True, description="the solver answers again after the critic's verdict")


VP = TypeVar("VP", bound=VerifiableParams)


def graded(score: float | None, reply: str) -> dict[str, Any]:
    """A step's info for a graded reply: its score, and ``malformed`` when it could not be parsed."""
    return {"score": score} | ({"malformed": reply[:40]} if score is None else {})


class _Verifiable(Environment[VP]):
    scripted_players: ClassVar[tuple[str, ...]] = ("oracle", "wrong", "yes")
    scripted_roles: ClassVar[dict[str, tuple[str, ...]]] = {"wrong": ("solver",), "yes": ("critic",)}
    Params: ClassVar[type[EnvParams]] = VerifiableParams
    env_name: ClassVar[str] = "verifiable"

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        self.task = self.make_task(self.rng)
        self.replies: list[tuple[str, str]] = []
        self.scores: list[float | None] = []
        self.critic = 0.0  # the critic's reward, once it has judged

    @abstractmethod
    def make_task(self, rng: random.Random) -> Task:
        """The episode's task, drawn from ``rng`` (the group's seed)."""

    async def grade(self, reply: str) -> float | None:
        return self.task.grade(reply)

    def _solver_reward(self, score: float | None) -> float:
        return -self.params.format_penalty if score is None else score

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if role == "critic":
            if player == "yes":
                return "CORRECT"
            if player == "oracle":
                return "CORRECT" if self.scores and self.scores[0] == 1.0 else "WRONG"
        elif player == "oracle":
            return self.task.reference
        elif player == "wrong":
            return self.task.wrong
        raise ValueError(f"scripted player {player!r} cannot play {role!r}; choose from {self.scripted_players}")

    def summary(self) -> dict[str, Any]:
        """The episode, and what evaluations average: the final answer's ``score`` (0 when unparsed), whether it
        is ``right``, and how many of the solver's answers could not be parsed (``unparsed``)."""
        final = self.scores[-1] if self.scores else None
        return {"task": self.task.prompt[:200], "reference": self.task.reference[:200], "scores": self.scores,
                "replies": [(r, t[:200]) for r, t in self.replies], "score": final or 0.0,
                "right": int(final == 1.0), "unparsed": sum(s is None for s in self.scores)}


class SolveEnv(_Verifiable):
    roles: ClassVar[tuple[str, ...]] = ("solver",)

    def current_role(self) -> str:
        return "solver"

    def observation(self, role: str) -> str:
        return self.task.prompt

    async def step(self, role: str, reply: str) -> StepResult:
        score = await self.grade(reply)
        self.replies.append((role, reply))
        self.scores.append(score)
        return StepResult(done=True, rewards={"solver": self._solver_reward(score)}, info=graded(score, reply))


class SolveCriticEnv(_Verifiable):
    roles: ClassVar[tuple[str, ...]] = ("solver", "critic")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The critic form of a task family (``class MathCritic(_MathMixin, SolveCriticEnv)``): the family's
        parameters plus the critic's (``CriticParams``), and the family's ``env_name`` plus ``_critic``."""
        super().__init_subclass__(**kwargs)
        if not issubclass(cls.Params, CriticParams):
            name = f"{cls.Params.__name__.removesuffix('Params')}CriticParams"
            cls.Params = create_model(name, __base__=(cls.Params, CriticParams), __module__=cls.__module__)
            cls.env_name = f"{cls.env_name}_critic"

    def current_role(self) -> str:
        return "critic" if len(self.replies) == 1 else "solver"

    def observation(self, role: str) -> str:
        if role == "critic":
            return f"{self.task.prompt}\nAnswer: {self.replies[0][1]}\nCORRECT or WRONG?"
        if not self.replies:
            return self.task.prompt
        return f"Critic: {self.replies[1][1][:200] or '(no verdict)'}\nYour final answer:"

    async def step(self, role: str, reply: str) -> StepResult:
        self.check_turn(role)
        self.replies.append((role, reply))
        if role == "solver":
            score = await self.grade(reply)
            self.scores.append(score)
            if len(self.replies) == 1:
                return StepResult(done=False, info=graded(score, reply))
            return StepResult(done=True, rewards={"solver": self._solver_reward(score), "critic": self.critic},
                              info=graded(score, reply))
        m = VERDICT.search(reply)
        if m is None:
            self.critic = -self.params.format_penalty
        else:
            self.critic = 1.0 if (m.group(1).lower() == "correct") == (self.scores[0] == 1.0) else -1.0
        info: dict[str, Any] = {"verdict": m and m.group(1)} | ({} if m else {"malformed": reply[:40]})
        if not self.params.revise:
            return StepResult(done=True, rewards={"solver": self._solver_reward(self.scores[0]),
                                                  "critic": self.critic}, info=info)
        return StepResult(done=False, info=info)
