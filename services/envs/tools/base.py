"""The tool interface, the registry (built-in names and ``package.module:Name`` plug-ins) and ``ToolBox``.

A ``Tool`` is made once per episode and role with a ``ToolContext`` (the episode's temporary directory); its
``call(arguments)`` returns the text the agent sees, or raises ``ToolFailure`` with a message for the agent.
A ``ToolBox`` holds one role's tools for an episode: it runs calls under the limits (calls per turn and per
episode, seconds per call), answers a malformed or failing call with an error message, and removes the
temporary directory at the end. ``describe`` is the block a system message shows the model: the tools as
JSON function signatures inside ``<tools>``, as SmolLM2's and Qwen's templates write them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, field_validator

from services.envs.params import ChatParams
from services.envs.tools.calls import ToolCall, ToolCallError, parse_tool_call

BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "services.envs.tools.calculator:Calculator",
    "python": "services.envs.tools.repl:PythonRepl",
    "files": "services.envs.tools.files:ScratchFiles",
    "search": "services.envs.tools.search:Search",
}
MAX_RESULT_CHARS = 2000


class ToolFailure(Exception):
    """A call the tool refuses (bad arguments, a failed computation): the message goes back to the agent."""


@dataclass
class ToolContext:
    workdir: Path  # the episode's temporary directory, removed at its end
    seconds: float = 5.0  # the time one call may take


class Tool(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]  # a JSON schema of the arguments (an "object")

    def __init__(self, ctx: ToolContext) -> None:
        self.ctx = ctx

    @abstractmethod
    async def call(self, arguments: dict[str, Any]) -> str:
        """Run the call; raise ToolFailure with a message for the agent when it cannot."""

    def close(self) -> None:  # noqa: B027 - most tools hold nothing
        """Release what the episode's calls held (the default: nothing)."""

    def first_parameter(self) -> str:
        return next(iter(self.parameters.get("properties", {})), "input")

    @classmethod
    def signature(cls) -> dict[str, Any]:
        return {"name": cls.name, "description": cls.description, "parameters": cls.parameters}


def load_tool(name: str) -> type[Tool]:
    """A built-in tool's name or a ``package.module:Name`` Tool subclass; raises ValueError saying why not."""
    from services.envs.registry import load_object

    path = BUILTIN_TOOLS.get(name, name)
    if ":" not in path:
        raise ValueError(f"unknown tool {name!r}; built-ins: {', '.join(sorted(BUILTIN_TOOLS))} "
                         "or a plug-in as package.module:Name")
    cls = load_object(path)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"{path!r} is not a Tool subclass")
    return cls


@dataclass
class Limits:
    per_turn: int = 4
    per_episode: int = 8
    seconds: float = 5.0


@dataclass
class ToolOutcome:
    """One call as the transcript records it."""

    name: str
    arguments: dict[str, Any]
    result: str
    error: bool = False

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "result": self.result, "error": self.error}


@dataclass
class ToolBox:
    """One role's tools for one episode."""

    names: tuple[str, ...]
    limits: Limits = field(default_factory=Limits)
    calls: int = 0
    turn_calls: int = 0

    def __post_init__(self) -> None:
        self.classes = {cls.name: cls for cls in map(load_tool, self.names)}
        self.workdir = Path(tempfile.mkdtemp(prefix="tandem-tools-"))
        ctx = ToolContext(self.workdir, self.limits.seconds)
        self.tools: dict[str, Tool] = {name: cls(ctx) for name, cls in self.classes.items()}

    def describe(self) -> str:
        sigs = "\n".join(json.dumps(c.signature()) for c in self.classes.values())
        return ("You may call tools. Their signatures:\n<tools>\n" + sigs + "\n</tools>\nTo call one, reply with "
                '<tool_call>{"name": NAME, "arguments": {...}}</tool_call> and nothing after it; the result '
                "comes back as a tool message. Reply without a tool call to give your answer.")

    def new_turn(self) -> None:
        self.turn_calls = 0

    def can_call(self) -> bool:
        return self.turn_calls < self.limits.per_turn and self.calls < self.limits.per_episode

    def parse(self, reply: str, cut: bool = False) -> ToolCall | ToolOutcome | None:
        """The reply's call, an error outcome for a malformed one, or None (a final reply); ``cut``: the reply
        ended at its token budget, which the error then names (a call cut short reads as broken JSON)."""
        try:
            return parse_tool_call(reply)
        except ToolCallError as exc:
            why = " (the reply was cut off at its max_new_tokens)" if cut else ""
            return ToolOutcome("?", {}, f"error: {exc}{why}", error=True)

    async def run(self, call: ToolCall | ToolOutcome) -> ToolOutcome:
        """Run one call (counted against the limits); failures come back as error outcomes."""
        self.calls += 1
        self.turn_calls += 1
        if isinstance(call, ToolOutcome):
            return call
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutcome(call.name, call.arguments,
                               f"error: no tool {call.name!r} (tools: {', '.join(self.tools)})", True)
        args = dict(call.arguments)
        if call.text is not None:
            args[tool.first_parameter()] = call.text
        try:
            result = await asyncio.wait_for(tool.call(args), self.limits.seconds)
        except ToolFailure as exc:
            return ToolOutcome(call.name, args, f"error: {exc}"[:MAX_RESULT_CHARS], True)
        except TimeoutError:
            return ToolOutcome(call.name, args, f"error: the call took longer than {self.limits.seconds:g}s", True)
        return ToolOutcome(call.name, args, result[:MAX_RESULT_CHARS])

    def close(self) -> None:
        for tool in self.tools.values():
            tool.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class ToolParams(ChatParams):
    """Parameters of an environment whose roles may call tools (``Environment.default_tools``)."""

    tools: dict[str, list[str]] | None = Field(
        None, description="per role, the tools it may call (built-in names or package.module:Name); "
        "unset: the environment's default tools")
    max_tool_calls_per_turn: int = Field(4, ge=0, le=64, description="tool calls one turn may make; a reply "
                                         "with a call past it is the turn's final reply")
    max_tool_calls_per_episode: int = Field(8, ge=0, le=256, description="tool calls one role may make in "
                                            "an episode")
    tool_seconds: float = Field(5.0, gt=0.0, le=120.0, description="wall-clock seconds one tool call may take")

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, tools: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        for names in (tools or {}).values():
            for name in names:
                load_tool(name)  # raises ValueError naming the tool
        return tools

    def limits(self) -> Limits:
        return Limits(self.max_tool_calls_per_turn, self.max_tool_calls_per_episode, self.tool_seconds)
