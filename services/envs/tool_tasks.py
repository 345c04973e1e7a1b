"""Environments whose agents need tools: ``tool_math`` (one solver) and ``tool_relay`` (researcher and buyer).

``tool_math``: arithmetic word problems with operands too large to do in one's head; the solver may call the
``calculator`` and ``python`` tools and replies with the final integer (graded by its last integer: 1 right,
0 wrong, ``-format_penalty`` with no integer).

``tool_relay``, both roles trained: the researcher is asked what ``n`` units of a catalogue item cost; it can
``search`` the shipped catalogue (services/envs/data/catalogue.jsonl) and use the ``calculator``, then reports.
The buyer sees only the report and its budget and replies BUY (the units cost at most the budget) or SKIP.
Both get +1 when the buyer's decision is right and -1 when it is wrong (the buyer ``-format_penalty`` with no
decision; the researcher then 0); the researcher also gets ``report_bonus`` when its report's last integer is
the exact total. Scripted players: researcher ``oracle``/``wrong``; buyer ``oracle`` (knows the truth),
``trusting`` (acts on the report's last integer) and ``random``.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, ClassVar

from pydantic import Field

from services.envs.base import Environment, StepResult
from services.envs.math_tasks import INTEGER, MathDatasetParams, MathTask
from services.envs.params import SHAPING
from services.envs.tools.base import ToolParams
from services.envs.tools.calls import format_tool_call
from services.envs.tools.search import CATALOGUE
from services.envs.verifiable import SolveEnv, Task, VerifiableParams, _Verifiable

DECISION = re.compile(r"\b(buy|skip)\b", re.IGNORECASE)


def word_problem(rng: random.Random, n: int) -> MathTask:
    """One of three word problems with operands up to ``n``."""
    a, b, c = rng.randint(n // 10 + 2, n), rng.randint(n // 10 + 2, n), rng.randint(2, 30)
    kind = rng.randrange(3)
    if kind == 0:
        prompt, answer = (f"A depot ships {a} crates a day and each crate holds {b} jars. How many jars does it "
                          f"ship in {c} days?"), a * b * c
        expression = f"{a}*{b}*{c}"
    elif kind == 1:
        total = a * b + rng.randint(0, n)
        prompt, answer = (f"A trader has {total} coins and buys {a} sacks at {b} coins each. How many coins are "
                          "left?"), total - a * b
        expression = f"{total}-{a}*{b}"
    else:
        prompt, answer = (f"{c} workers each pack {a} boxes a week, and a truck carries {b} boxes. How many "
                          f"boxes do the workers pack in 4 weeks, plus {b} more?"), 4 * c * a + b
        expression = f"4*{c}*{a}+{b}"
    return MathTask(prompt=prompt, reference=str(answer), wrong=str(answer + 1), answer=answer, expression=expression)


class ToolMathParams(ToolParams, VerifiableParams, MathDatasetParams):
    max_operand: int = Field(999, ge=10, le=10**6, description="the largest operand in a problem")


class _ToolMathMixin(_Verifiable[ToolMathParams]):
    env_name: ClassVar[str] = "tool_math"
    default_tools: ClassVar[dict[str, tuple[str, ...]]] = {"solver": ("calculator", "python")}
    default_system: ClassVar[dict[str, str]] = {
        "solver": "Solve the word problem. Use a tool for the arithmetic, then reply with only the final integer."}
    summary_measures: ClassVar[tuple[str, ...] | None] = ("score", "right", "unparsed", "tool_calls")
    demonstrated_roles: ClassVar[tuple[str, ...]] = ("solver",)

    def __init__(self, params: dict[str, Any] | ToolMathParams, seed: int) -> None:
        super().__init__(params, seed)
        self.tool_calls = 0

    def make_task(self, rng: random.Random) -> Task:
        if (task := self.params.dataset_task(rng)) is not None:
            return task
        return word_problem(rng, self.params.max_operand)

    def tool_used(self, role: str, call: dict[str, Any]) -> None:
        self.tool_calls += 1

    def demonstration(self, role: str, step: int) -> str:
        """The calculator on the problem's arithmetic, then the integer alone."""
        task = self.task
        if role != "solver":
            return super().demonstration(role, step)
        if not isinstance(task, MathTask) or not task.expression:
            raise ValueError("the solver's demonstration needs the generator's problems: a task from "
                             "environment.dataset has no arithmetic to give the calculator")
        self.needs_tools(role, "calculator")
        if step == 0:
            return format_tool_call("calculator", {"expression": task.expression})
        return str(task.answer)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "tool_calls": self.tool_calls}


class ToolMath(_ToolMathMixin, SolveEnv):
    description: ClassVar[str] = "Math word problems with big numbers; the solver may call a calculator and Python."


class ToolRelayParams(ToolParams):
    max_units: int = Field(40, ge=2, le=1000, description="the most units the buyer asks for")
    format_penalty: float = Field(0.5, ge=0.0, le=10.0, description="the buyer's penalty for no BUY/SKIP")
    report_bonus: float = Field(0.5, ge=0.0, le=5.0, description="the researcher's bonus for the exact total",
                                json_schema_extra=SHAPING)


def catalogue() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CATALOGUE.read_text().splitlines() if line.strip()]


class ToolRelay(Environment[ToolRelayParams]):
    roles: ClassVar[tuple[str, ...]] = ("researcher", "buyer")
    description: ClassVar[str] = ("The researcher looks a price up with search and a calculator and reports; the "
                                  "buyer acts on the report (BUY or SKIP): both +1 right, -1 wrong.")
    env_name: ClassVar[str] = "tool_relay"
    scripted_players: ClassVar[tuple[str, ...]] = ("oracle", "wrong", "trusting", "random")
    scripted_roles: ClassVar[dict[str, tuple[str, ...]]] = {"wrong": ("researcher",), "trusting": ("buyer",),
                                                            "random": ("buyer",)}
    default_tools: ClassVar[dict[str, tuple[str, ...]]] = {"researcher": ("search", "calculator")}
    default_system: ClassVar[dict[str, str]] = {
        "researcher": "Find the item's price with the search tool, compute the total with the calculator, then "
                      "reply with a one-line report ending in the total cost as an integer.",
        "buyer": "Reply with one word: BUY if the units cost at most your budget, otherwise SKIP."}
    summary_measures: ClassVar[tuple[str, ...] | None] = ("right", "report_right", "tool_calls", "undecided")
    demonstrated_roles: ClassVar[tuple[str, ...]] = ("researcher", "buyer")

    def __init__(self, params: dict[str, Any] | ToolRelayParams, seed: int) -> None:
        super().__init__(params, seed)
        self.item = self.rng.choice(catalogue())
        self.units = self.rng.randint(2, self.params.max_units)
        self.total = self.item["price"] * self.units
        self.budget = max(1, self.total + self.rng.choice((-1, 1)) * self.rng.randint(1, max(1, self.total // 5)))
        self.report: str | None = None
        self.decision: str | None = None
        self.tool_calls = 0

    def current_role(self) -> str:
        return "researcher" if self.report is None else "buyer"

    def observation(self, role: str) -> str:
        if role == "researcher":
            return (f"The buyer wants {self.units} units of {self.item['title'].lower()}. What do they cost in "
                    "total? Report the total in coins.")
        return (f"Report from the researcher: {(self.report or '')[:300]}\nYou have {self.budget} coins for "
                f"{self.units} units of {self.item['title'].lower()}. BUY or SKIP?")

    def tool_used(self, role: str, call: dict[str, Any]) -> None:
        self.tool_calls += 1

    def reported_total(self) -> int | None:
        found = INTEGER.findall(self.report or "")
        return int(found[-1]) if found else None

    async def step(self, role: str, reply: str) -> StepResult:
        self.check_turn(role)
        if role == "researcher":
            self.report = reply
            return StepResult(done=False, info={"reported": self.reported_total()})
        m = DECISION.search(reply)
        bonus = self.params.report_bonus if self.reported_total() == self.total else 0.0
        if m is None:
            return StepResult(done=True, rewards={"buyer": -self.params.format_penalty, "researcher": bonus},
                              info={"malformed": reply[:40]})
        self.decision = m.group(1).upper()
        right = (self.decision == "BUY") == (self.total <= self.budget)
        outcome = 1.0 if right else -1.0
        return StepResult(done=True, rewards={"buyer": outcome, "researcher": outcome + bonus},
                          info={"decision": self.decision})

    def default_system_prompt(self, role: str) -> str:
        if role == "buyer" and "calculator" in self.tool_names(role):
            return ("Subtract the report's total from your budget with the calculator, then reply with one word: "
                    "BUY if the units cost at most your budget (the difference is not negative), otherwise SKIP.")
        return super().default_system_prompt(role)

    def demonstration(self, role: str, step: int) -> str:
        """The researcher searches the item, multiplies on the calculator and reports; the buyer (with the
        calculator when the config gives it one: budget minus the reported total) decides right."""
        if role == "buyer":
            reported = self.reported_total()
            if step == 0 and "calculator" in self.tool_names(role) and reported is not None:
                return format_tool_call("calculator", {"expression": f"{self.budget}-{reported}"})
            return "BUY" if self.total <= self.budget else "SKIP"
        if role != "researcher":
            return super().demonstration(role, step)
        self.needs_tools(role, "search", "calculator")
        if step == 0:
            return format_tool_call("search", {"query": self.item["title"].lower()})
        if step == 1:
            return format_tool_call("calculator", {"expression": f"{self.item['price']}*{self.units}"})
        return f"{self.units} units at {self.item['price']} coins each cost {self.total}"

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if role == "researcher":
            if player not in ("oracle", "wrong"):
                raise ValueError(f"scripted player {player!r} cannot play researcher")
            total = self.total if player == "oracle" else self.total + self.item["price"]
            return f"{self.units} units at {self.item['price']} coins cost {total}"
        if player == "oracle":
            return "BUY" if self.total <= self.budget else "SKIP"
        if player == "trusting":
            reported = self.reported_total()
            return "SKIP" if reported is None or reported > self.budget else "BUY"
        if player == "random":
            return rng.choice(("BUY", "SKIP"))
        raise ValueError(f"scripted player {player!r} cannot play buyer")

    def summary(self) -> dict[str, Any]:
        right = self.decision is not None and (self.decision == "BUY") == (self.total <= self.budget)
        return {"item": self.item["title"], "units": self.units, "total": self.total, "budget": self.budget,
                "report": (self.report or "")[:300], "decision": self.decision, "right": int(right),
                "report_right": int(self.reported_total() == self.total), "tool_calls": self.tool_calls,
                "undecided": int(self.report is not None and self.decision is None)}
