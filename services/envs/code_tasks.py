"""Code with tests: single-agent (``code``) or coder and critic (``code_critic``).

Each episode draws a small function-writing task from the seed (constants
vary by seed). The reply's program (the first fenced code block, closed or cut short by the token
limit, else the reply from its first ``def f`` on) must define ``f``; it runs with the task's test cases in the sandbox
(sandbox.py: CPU time, memory, wall clock, no network, stripped environment).
Score: the fraction of test cases passed (1 only when all pass). A reply that
does not compile or defines no ``f`` is unparseable (``-format_penalty``).
The roles and rewards are those of verifiable.py (``coder`` is its ``solver``).

Parameters: ``cpu_s`` (1..10), ``memory_mb`` (64..2048), ``wall_s`` (1..30),
``format_penalty``, and ``revise`` for the coder-critic form.
"""

from __future__ import annotations

import ast
import asyncio
import json
import random
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field, field_validator

from services.envs.datasets import DatasetSpec
from services.envs.sandbox import run_python
from services.envs.verifiable import SolveCriticEnv, SolveEnv, Task, VerifiableParams, _Verifiable

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
DEF_F = re.compile(r"^def f\s*\(", re.MULTILINE)


def _defines_f(source: str) -> bool:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, ast.FunctionDef) and n.name == "f" for n in tree.body)


def extract_program(reply: str) -> str | None:
    """The program in a reply: the first fenced block (closed, or cut short at the reply's end), else the whole
    reply, else the reply from its first ``def f`` on (prose before the code); None if none compiles and
    defines a function ``f``."""
    m = FENCE.search(reply)
    candidates = [m.group(1)] if m else [reply]
    if m is None and (d := DEF_F.search(reply)) is not None:
        candidates.append(reply[d.start():])
    return next((c for c in candidates if _defines_f(c)), None)


@dataclass
class CodeTask(Task):
    cases: list[tuple[tuple[Any, ...], Any]] = field(default_factory=list)
    limits: dict[str, Any] = field(default_factory=dict)

    def grade(self, reply: str) -> float | None:
        program = extract_program(reply)
        if program is None:
            return None
        token = secrets.token_hex(8)
        harness = (f"{program}\n\n_cases = {self.cases!r}\n_ok = 0\nfor _a, _e in _cases:\n"
                   f"    try:\n        _ok += f(*_a) == _e\n    except Exception:\n        pass\n"
                   f"print('{token}', _ok)\n")
        result = run_python(harness, **self.limits)
        for line in reversed(result.stdout.splitlines()):
            if line.startswith(token + " "):
                return int(line.split()[1]) / len(self.cases)
        return 0.0  # crashed, timed out or ran out of memory


def make_code_task(rng: random.Random, limits: dict[str, Any]) -> CodeTask:
    kind = rng.choice(["add", "mul", "count", "reverse", "largest"])
    k = rng.randint(2, 9)
    if kind == "add":
        prompt, body, wrong = f"Write f(x) returning x+{k}.", f"x + {k}", f"x + {k + 1}"
        cases = [((x,), x + k) for x in (0, 1, -3, 10)]
    elif kind == "mul":
        prompt, body, wrong = f"Write f(x) returning x*{k}.", f"x * {k}", f"x * {k} + 1"
        cases = [((x,), x * k) for x in (0, 2, -3, 7)]
    elif kind == "count":
        c = rng.choice("abc")
        prompt, body, wrong = f"Write f(s) returning how many '{c}' are in s.", f"s.count({c!r})", "len(s)"
        cases = [((s,), s.count(c)) for s in ("", "abcabc", "aaab", "ccc")]
    elif kind == "reverse":
        prompt, body, wrong = "Write f(s) returning s reversed.", "s[::-1]", "s"
        cases = [((s,), s[::-1]) for s in ("", "ab", "xyz", "tandem")]
    else:
        prompt, body, wrong = "Write f(xs) returning the largest number in xs.", "max(xs)", "xs[0]"
        cases = [((xs,), max(xs)) for xs in ([1], [3, 9, 2], [-5, -2], [k, 0, k + 1])]
    arg = "s" if "(s)" in prompt else "xs" if "(xs)" in prompt else "x"
    return CodeTask(prompt=prompt, reference=f"```python\ndef f({arg}):\n    return {body}\n```",
                    wrong=f"```python\ndef f({arg}):\n    return {wrong}\n```", cases=cases, limits=limits)


def code_task_from(row: dict[str, Any], spec: DatasetSpec, limits: dict[str, Any]) -> CodeTask:
    """A dataset row as a task: its ``prompt`` column, its ``tests`` column (a list of [arguments, expected]
    pairs for ``f``, or that list as JSON text) and, when mapped or present, a ``reference`` solution."""
    tests = row[spec.column("tests")]
    tests = json.loads(tests) if isinstance(tests, str) else tests
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"{spec.path}: tests must be a non-empty list of [arguments, expected] pairs")
    cases = [(tuple(args), expected) for args, expected in tests]
    return CodeTask(prompt=str(row[spec.column("prompt")]), reference=str(row.get(spec.column("reference"), "")),
                    wrong="```python\ndef f(*args):\n    return None\n```", cases=cases, limits=limits)


class CodeParams(VerifiableParams):
    cpu_s: int = Field(2, ge=1, le=10, description="sandbox CPU seconds")
    memory_mb: int = Field(256, ge=64, le=2048, description="sandbox memory")
    wall_s: float = Field(5.0, ge=1.0, le=30.0, description="sandbox wall clock")
    dataset: DatasetSpec | None = Field(None, description="draw the tasks from a local dataset (prompt, tests, "
                                        "optional reference) instead of generating them (docs/guides/datasets.md)")

    @field_validator("dataset")
    @classmethod
    def _has_code_fields(cls, dataset: DatasetSpec | None) -> DatasetSpec | None:
        if dataset is not None:
            dataset.require("prompt", "tests")
        return dataset


class _CodeMixin(_Verifiable[CodeParams]):
    env_name: ClassVar[str] = "code"
    summary_measures: ClassVar[tuple[str, ...] | None] = ("score", "right", "unparsed")
    default_system: ClassVar[dict[str, str]] = {
        "solver": ("You write Python. Reply with only a function named f in a ```python code block: no "
                   "explanation, no tests, no example calls."),
        "critic": ("You check another player's Python function. Reply with one word: CORRECT if it does what the "
                   "task asks, WRONG if it does not."),
    }

    def make_task(self, rng: random.Random) -> Task:
        p = self.params
        limits = {"cpu_s": p.cpu_s, "memory_mb": p.memory_mb, "wall_s": p.wall_s}
        if p.dataset is not None:
            return code_task_from(p.dataset.draw(rng), p.dataset, limits)
        return make_code_task(rng, limits)

    async def grade(self, reply: str) -> float | None:
        return await asyncio.to_thread(self.task.grade, reply)  # a subprocess: keep it off the event loop


class Code(_CodeMixin, SolveEnv):
    description: ClassVar[str] = "Write a Python function; graded by tests run in a sandbox (time, memory, no net)."


class CodeCritic(_CodeMixin, SolveCriticEnv):
    description: ClassVar[str] = ("Code, solver and critic: the critic judges the program, the solver may revise; "
                                  "the final program is graded in the sandbox.")
