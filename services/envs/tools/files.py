"""A scratch file system confined to the episode's temporary directory: list, read and write text files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from services.envs.tools.base import Tool, ToolFailure

MAX_FILE_BYTES = 64 << 10
MAX_FILES = 64


class ScratchFiles(Tool):
    name: ClassVar[str] = "files"
    description: ClassVar[str] = ("A scratch directory for this episode: op 'list', 'read' (path) or 'write' "
                                  "(path, text). Paths are relative; nothing outside it can be reached.")
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {
            "op": {"type": "string", "enum": ["list", "read", "write"]},
            "path": {"type": "string"}, "text": {"type": "string"}},
        "required": ["op"]}

    def resolve(self, path: Any) -> Path:
        """``path`` inside the scratch directory; raises ToolFailure for one that leaves it."""
        if not isinstance(path, str) or not path:
            raise ToolFailure("a path is required")
        root = self.ctx.workdir.resolve()
        target = (root / path).resolve()
        if not target.is_relative_to(root) or target == root:
            raise ToolFailure(f"{path!r} is outside the scratch directory")
        return target

    async def call(self, arguments: dict[str, Any]) -> str:
        op = arguments.get("op")
        root = self.ctx.workdir.resolve()
        if op == "list":
            names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
            return "\n".join(names) or "(empty)"
        if op == "read":
            target = self.resolve(arguments.get("path"))
            if not target.is_file():
                raise ToolFailure(f"no file {arguments.get('path')!r}")
            return target.read_text(errors="replace")[:MAX_FILE_BYTES]
        if op == "write":
            target = self.resolve(arguments.get("path"))
            text = arguments.get("text", "")
            if not isinstance(text, str) or len(text.encode()) > MAX_FILE_BYTES:
                raise ToolFailure(f"text must be a string of at most {MAX_FILE_BYTES} bytes")
            if not target.exists() and sum(1 for p in root.rglob("*") if p.is_file()) >= MAX_FILES:
                raise ToolFailure(f"at most {MAX_FILES} files")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            return f"wrote {len(text)} characters to {target.relative_to(root)}"
        raise ToolFailure("op must be 'list', 'read' or 'write'")
