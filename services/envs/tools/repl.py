"""A Python REPL: one sandboxed interpreter per episode and role that keeps its variables between calls.

The interpreter runs under the code sandbox's limits (services/envs/sandbox.py: ``RLIMIT_CPU`` for the whole
session, ``RLIMIT_AS`` memory, no child processes for non-root, small file sizes, an empty environment,
``python -I -S``), in the episode's temporary directory (the ``files`` tool sees the same files). Where the
kernel allows user namespaces (``can_confine``) it also gets an empty network namespace and a private mount
namespace in which every mount but that directory is read-only. Each cell has a wall-clock limit; a cell
that overruns it, or exhausts the session's CPU, kills the interpreter, and the next call starts a fresh one
(the agent is told). Cells go in as JSON lines on stdin; answers come back on stdout as lines tagged with a
per-session nonce.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from typing import Any, ClassVar

from services.envs.sandbox import _limits, can_unshare_net
from services.envs.tools.base import Tool, ToolFailure

MAX_OUTPUT = 4000
DRIVER = r"""
import ast, contextlib, io, json, sys, traceback
def serve(nonce, out):
    env = {"__name__": "__main__"}
    for line in sys.stdin:
        code, buf = json.loads(line)["code"], io.StringIO()
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                tree = ast.parse(code, "<cell>", "exec")
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                exec(compile(tree, "<cell>", "exec"), env)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), env)
                    if value is not None:
                        print(repr(value))
        except BaseException:
            buf.write(traceback.format_exc(limit=-3))
        out.write(nonce + json.dumps({"out": buf.getvalue()[:%d]}) + "\n")
        out.flush()
serve(sys.stdin.readline().strip(), sys.stdout)
""".replace("%d", str(MAX_OUTPUT))


# run in the working directory: every mount read-only but the working directory (a private mount namespace)
READ_ONLY = r"""w="$PWD"; mount --bind "$w" "$w" && cd "$w" || exit 97
while read -r dev m rest; do [ "$m" = "$w" ] || mount -o remount,bind,ro "$m" 2>/dev/null; done < /proc/self/mounts
exec "$@"
"""


@functools.cache
def can_confine() -> bool:
    """Whether this kernel lets an unprivileged process have its own network and mount namespaces."""
    try:
        return can_unshare_net() and subprocess.run(
            ["unshare", "--net", "--mount", "--map-root-user", "sh", "-c", READ_ONLY, "sh", "true"],
            capture_output=True, timeout=10, cwd=tempfile.gettempdir()).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def confined(cmd: list[str]) -> list[str]:
    """``cmd`` with no network and a read-only file system outside its working directory, where the kernel
    allows it (``can_confine``); otherwise ``cmd`` with only the rlimits and the empty environment."""
    if can_confine():
        return ["unshare", "--net", "--mount", "--map-root-user", "sh", "-c", READ_ONLY, "sh", *cmd]
    return cmd


class PythonRepl(Tool):
    name: ClassVar[str] = "python"
    description: ClassVar[str] = ("Run Python code in a persistent session (variables stay between calls; "
                                  "standard library only, no network). Prints and the last expression's value "
                                  "come back.")
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
        "required": ["code"]}
    cpu_s: ClassVar[int] = 10  # for the whole session
    memory_mb: ClassVar[int] = 256

    proc: asyncio.subprocess.Process | None = None
    nonce: str = ""

    async def start(self) -> asyncio.subprocess.Process:
        self.nonce = "\x00" + secrets.token_hex(8) + ":"
        cmd = confined([sys.executable, "-I", "-S", "-c", DRIVER])
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=self.ctx.workdir, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            preexec_fn=lambda: _limits(self.cpu_s, self.memory_mb), limit=1 << 20)
        assert proc.stdin is not None
        proc.stdin.write((self.nonce + "\n").encode())
        return proc

    async def call(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolFailure('python takes {"code": "..."}')
        if self.proc is None:
            self.proc = await self.start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write((json.dumps({"code": code}) + "\n").encode())
            await proc.stdin.drain()
            answer = await asyncio.wait_for(self._answer(proc), self.ctx.seconds * 0.9)
        except TimeoutError:
            self.close()
            raise ToolFailure(f"the cell ran past {self.ctx.seconds * 0.9:.1f}s; the session was restarted "
                              "(variables are gone)") from None
        except (ConnectionError, EOFError):
            self.close()
            raise ToolFailure("the interpreter died (CPU or memory limit); the session was restarted "
                              "(variables are gone)") from None
        except BaseException:  # cancelled by the caller: do not leave a half-run cell behind
            self.close()
            raise
        return answer or "(no output)"

    async def _answer(self, proc: asyncio.subprocess.Process) -> str:
        assert proc.stdout is not None
        while True:
            line = (await proc.stdout.readline()).decode(errors="replace")
            if not line:
                raise EOFError
            if line.startswith(self.nonce):
                return str(json.loads(line[len(self.nonce):])["out"])

    def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None
