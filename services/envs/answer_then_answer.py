"""Answer then answer: A answers an arithmetic question, then B sees A's answer and answers.

The MinT multi-agent recipe's pattern. The question ``a <op> b`` is drawn
from the seed (operands 0..``max_operand``, ops from ``ops``), asked as a chat model reads it ("What is
3+4?"; the second role also sees the first answer), or with ``terse`` as the tiny demo model was trained
("3+4=", "3+4= A:7 You:").

Rewards, each role on its own answer: +1 right, 0 wrong, ``-format_penalty``
when the reply holds no integer (the last integer in the reply counts: "3 + 4 = 7" answers 7). An
unparseable first answer does not end the episode: B is shown "(no answer)". Each role's default system
message tells a chat model what to answer (``params.system`` replaces it; the demo models play without one).

``held_out`` keeps a share of the questions out of training: a question is held out by a hash of its text,
the same for every seed, so training episodes never ask it and evaluations (``evaluation_params``: ``split``
``eval``) ask only those.

Scripted players: ``correct``, ``wrong`` (off by one) and ``copy`` (repeats
the first answer, or answers correctly when it is first).
"""

from __future__ import annotations

import itertools
import operator
import random
import re
from functools import lru_cache
from typing import Any, ClassVar

from pydantic import Field, field_validator

from services.envs.base import Environment, StepResult
from services.envs.params import ChatParams, EnvParams, HeldOutParams, split_cases

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
INTEGER = re.compile(r"(?<!\w)-?\d+|\d+")  # a minus sign only where it starts a number: "1-16" is 1 and 16


def last_int(reply: str) -> int | None:
    """The last integer of a reply ("3 + 4 = 7" gives 7), or None when it has none."""
    found = INTEGER.findall(reply)
    return int(found[-1]) if found else None


class AnswerThenAnswerParams(ChatParams, HeldOutParams):
    max_operand: int = Field(9, ge=1, le=10**6)
    ops: str = Field("+-*", description="the operators questions draw from")
    format_penalty: float = Field(0.5, ge=0.0, le=10.0)
    terse: bool = Field(False, description="the tiny demo model's terse questions ('3+4=', then '3+4= A:7 You:'); "
                        "false: a chat model's ('What is 3+4?', then the question and the first answer in words)")

    @field_validator("ops")
    @classmethod
    def _known_ops(cls, ops: str) -> str:
        if not ops or set(ops) - set(OPS):
            raise ValueError(f"must be made of {''.join(OPS)}")
        return ops

    def check_splits(self) -> None:
        for split in ("train", "eval"):
            questions(self.max_operand, self.ops, self.held_out, split)


@lru_cache(maxsize=32)
def questions(max_operand: int, ops: str, held_out: float, split: str) -> tuple[tuple[int, str, int], ...]:
    """The (a, op, b) questions of ``split``: those held out (``eval``) or the rest (``train``)."""
    every = list(itertools.product(range(max_operand + 1), ops, range(max_operand + 1)))
    return tuple(split_cases(every, [f"{a}{op}{b}=" for a, op, b in every], held_out, split))


class AnswerThenAnswer(Environment[AnswerThenAnswerParams]):
    roles: ClassVar[tuple[str, ...]] = ("first", "second")
    description: ClassVar[str] = ("Arithmetic: the first role answers, the second sees that answer and answers; "
                                  "each +1 if right, -format_penalty if no integer.")
    scripted_players: ClassVar[tuple[str, ...]] = ("correct", "wrong", "copy")

    env_name: ClassVar[str] = "answer_then_answer"
    summary_measures: ClassVar[tuple[str, ...] | None] = ("first_right", "second_right", "copied")
    default_system: ClassVar[dict[str, str]] = {
        "first": "You are a calculator. Reply with only the number, nothing else.",
        "second": ("You are a calculator. You see a question and another player's answer, which may be wrong. "
                   "Reply with only the right number, nothing else."),
    }

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        p = self.params
        if p.held_out:
            a, op, b = self.rng.choice(questions(p.max_operand, p.ops, p.held_out, p.split))
        else:
            a, b = self.rng.randint(0, p.max_operand), self.rng.randint(0, p.max_operand)
            op = self.rng.choice(p.ops)
        self.question, self.answer = f"{a}{op}{b}=", OPS[op](a, b)
        self.replies: dict[str, int | None] = {}

    def current_role(self) -> str:
        return "first" if "first" not in self.replies else "second"

    def observation(self, role: str) -> str:
        first = self.replies.get("first")
        said = "(no answer)" if first is None else str(first)
        if self.params.terse:
            return self.question if role == "first" else f"{self.question} A:{said} You:"
        asked = f"What is {self.question.rstrip('=')}?"
        return asked if role == "first" else f"{asked} The first player answered: {said}. What is your answer?"

    def _reward(self, value: int | None) -> float:
        return -self.params.format_penalty if value is None else float(value == self.answer)

    async def step(self, role: str, reply: str) -> StepResult:
        self.check_turn(role)
        self.replies[role] = last_int(reply)
        info: dict[str, Any] = {"answer": self.replies[role]}
        if self.replies[role] is None:  # no integer: a format failure, counted in the malformed/illegal rates
            info["malformed"] = reply[:40] or "empty"
        if role == "first":
            return StepResult(done=False, info=info)
        return StepResult(done=True, rewards={r: self._reward(self.replies[r]) for r in self.roles},
                          info={**info, "truth": self.answer})

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if player == "correct":
            return str(self.answer)
        if player == "wrong":
            return str(self.answer + 1)
        if player == "copy":
            first = self.replies.get("first")
            return str(self.answer if role == "first" or first is None else first)
        raise ValueError(f"unknown scripted player {player!r}; choose from {self.scripted_players}")

    def summary(self) -> dict[str, Any]:
        """The episode, and what evaluations average: each answer right (1/0), the second a copy of the first."""
        first, second = self.replies.get("first"), self.replies.get("second")
        return {"question": self.question, "truth": self.answer, "answers": dict(self.replies),
                "first_right": int(first == self.answer), "second_right": int(second == self.answer),
                "copied": int(first is not None and second == first)}
