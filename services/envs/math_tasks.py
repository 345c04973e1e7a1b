"""Math with verifiable answers: single-agent (``math``) or solver and critic (``math_critic``).

Problems are generated from the seed, so every answer is known exactly:
* ``arith``: ``a*b+c`` style expressions with small operands;
* ``linear``: solve ``a*x+b=c`` for an integer ``x``.
A reply is graded by its *last* integer (so "x = 4" and "the answer is 4"
both count): 1 if equal to the answer, 0 otherwise; a reply with no integer
is unparseable (``-format_penalty``). See verifiable.py for the roles and rewards.

Parameters: ``kinds`` ("arith", "linear" or "arith,linear"), ``max_operand``
(1..1000), ``format_penalty``, and ``revise`` for the solver-critic form; ``dataset`` (``MathDatasetParams``,
also ``tool_math``'s) draws the problems from a local dataset instead.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field, field_validator

from services.envs.datasets import DatasetSpec
from services.envs.params import EnvParams
from services.envs.verifiable import SolveCriticEnv, SolveEnv, Task, VerifiableParams, _Verifiable

KINDS = ("arith", "linear")
INTEGER = re.compile(r"(?<!\w)-?\d+|\d+")  # a minus sign only where it starts a number: "1-16" is 1 and 16


@dataclass
class MathTask(Task):
    answer: int = 0
    expression: str = ""  # arithmetic whose value is ``answer`` (what a demonstration gives the calculator)

    def grade(self, reply: str) -> float | None:
        found = INTEGER.findall(reply)
        return None if not found else float(int(found[-1]) == self.answer)


def make_math_task(rng: random.Random, kinds: list[str], n: int) -> MathTask:
    kind = rng.choice(kinds)
    if kind == "arith":
        a, b, c = rng.randint(1, n), rng.randint(1, n), rng.randint(0, n)
        answer = a * b + c
        prompt = f"What is {a}*{b}+{c}?"
    else:
        a, x, b = rng.randint(2, max(2, n)), rng.randint(-n, n), rng.randint(0, n)
        answer = x
        prompt = f"Solve {a}x+{b}={a * x + b}. What is x?"
    return MathTask(prompt=prompt, reference=str(answer), wrong=str(answer + 1), answer=answer)


def math_task_from(row: dict, spec: DatasetSpec) -> MathTask:
    """A dataset row as a task: its ``question`` column, graded against the last integer of its ``answer``
    column (GSM8K's "... #### 72" included; thousands separators dropped)."""
    found = INTEGER.findall(str(row[spec.column("answer")]).replace(",", ""))
    if not found:
        raise ValueError(f"{spec.path}: answer {row[spec.column('answer')]!r} holds no integer")
    answer = int(found[-1])
    return MathTask(prompt=str(row[spec.column("question")]), reference=str(answer), wrong=str(answer + 1),
                    answer=answer)


class MathDatasetParams(EnvParams):
    """A ``dataset`` of math problems (``math`` and ``tool_math``): its rows need a question and an answer."""

    dataset: DatasetSpec | None = Field(None, description="draw the problems from a local dataset (question, "
                                        "answer) instead of generating them (docs/guides/datasets.md)")

    @field_validator("dataset")
    @classmethod
    def _has_math_fields(cls, dataset: DatasetSpec | None) -> DatasetSpec | None:
        if dataset is not None:
            dataset.require("question", "answer")
        return dataset

    def dataset_task(self, rng: random.Random) -> MathTask | None:
        """A problem drawn from the dataset; None without one (the environment generates its own)."""
        return None if self.dataset is None else math_task_from(self.dataset.draw(rng), self.dataset)


class MathParams(VerifiableParams, MathDatasetParams):
    kinds: str = Field("arith,linear", description=f"a comma list of {', '.join(KINDS)}")
    max_operand: int = Field(9, ge=1, le=1000)

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, kinds: str) -> str:
        if any(k.strip() not in KINDS for k in kinds.split(",")):
            raise ValueError(f"must be a comma list of {list(KINDS)}")
        return kinds


class _MathMixin(_Verifiable[MathParams]):
    env_name: ClassVar[str] = "math"
    summary_measures: ClassVar[tuple[str, ...] | None] = ("score", "right", "unparsed")
    default_system: ClassVar[dict[str, str]] = {
        "solver": "You are a calculator. Solve the problem. Reply with only the final integer, nothing else.",
        "critic": ("You check another player's answer to a math problem. Reply with one word: CORRECT if the "
                   "answer is right, WRONG if it is not."),
    }

    def make_task(self, rng: random.Random) -> Task:
        if (task := self.params.dataset_task(rng)) is not None:
            return task
        return make_math_task(rng, [k.strip() for k in self.params.kinds.split(",")], self.params.max_operand)


class Math(_MathMixin, SolveEnv):
    description: ClassVar[str] = "Math with a verifiable integer answer, one solver: +1 right, 0 wrong."


class MathCritic(_MathMixin, SolveCriticEnv):
    description: ClassVar[str] = ("Math, solver and critic: the critic judges the answer (+1 if its verdict is "
                                  "right), the solver may revise; the final answer is graded.")
