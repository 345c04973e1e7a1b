"""Parse a tool call out of a model's reply.

The format is the one SmolLM2's and Qwen's chat templates teach:
``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``.
A plain fallback for models without it: a line ``CALL name {"arg": ...}``, or ``CALL name text`` where the text
becomes the tool's first parameter. The first call in a reply counts. A call that cannot be read is a
``ToolCallError`` (answered to the agent as an error message); a reply without one is a final reply.
``format_tool_call`` writes a call in the tagged format (demonstrations).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PLAIN = re.compile(r"^\s*CALL\s+([A-Za-z_][\w.-]*)\s*(.*?)\s*$", re.MULTILINE)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    text: str | None = None  # a plain call's free text (for the tool's first parameter)


class ToolCallError(ValueError):
    """A reply that tries to call a tool but cannot be read; the message says why."""


def parse_tool_call(reply: str) -> ToolCall | None:
    """The first tool call in ``reply``, None when it has none; raises ToolCallError for a malformed one."""
    m = TAGGED.search(reply)
    if m is not None:
        try:
            body = json.loads(m.group(1).strip())
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"the tool call is not JSON ({exc.msg} at {exc.pos})") from None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise ToolCallError('a tool call is {"name": ..., "arguments": {...}}')
        args = body.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ToolCallError("the arguments are not a JSON object") from None
        if not isinstance(args, dict):
            raise ToolCallError("the arguments are not a JSON object")
        return ToolCall(body["name"], args)
    p = PLAIN.search(reply)
    if p is None:
        return None
    name, rest = p.group(1), p.group(2)
    if rest.startswith("{"):
        try:
            args = json.loads(rest)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"the arguments are not JSON ({exc.msg} at {exc.pos})") from None
        if not isinstance(args, dict):
            raise ToolCallError("the arguments are not a JSON object")
        return ToolCall(name, args)
    return ToolCall(name, {}, text=rest)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call in the tagged format, as ``parse_tool_call`` reads it back."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
