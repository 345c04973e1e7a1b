"""A plug-in tool defined outside services/, loaded by ``tests.plugin_tool:Slow``: it sleeps as
long as it is told.

A module of its own rather than a class in a test module: loading it by path imports it plainly, with no
second assertion-rewriting pass over a test file in the middle of a run.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.envs.tools.base import Tool


class Slow(Tool):
    """Sleeps ``seconds`` and says so."""

    name = "slow"
    description = "Sleep."
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}}}

    async def call(self, arguments: dict[str, Any]) -> str:
        await asyncio.sleep(float(arguments.get("seconds", 0)))
        return "awake"
