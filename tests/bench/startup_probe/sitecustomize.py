"""Start-up probe for ``tests/bench/startup_phases.py`` (on PYTHONPATH only there; docs/architecture.md §9).

In every Python process of a ``tandem up`` it writes, to ``$TANDEM_STARTUP_PROBE/<pid>.jsonl``, the
wall-clock time of: the interpreter's start, the first import of torch, transformers and uvicorn,
the first socket connect (its imports are done and it talks to Redis or an HTTP server), every
socket bind (a server listening) and every child process it spawns. Tree-independent: it changes
no code, so an old tree is measured the same way.
"""

import json
import os
import sys
import time

_DIR = os.environ.get("TANDEM_STARTUP_PROBE")
if _DIR:
    with open("/proc/self/cmdline", "rb") as _f:
        _CMD = [a.decode(errors="replace") for a in _f.read().split(b"\0") if a]
    _PATH = os.path.join(_DIR, f"{os.getpid()}.jsonl")
    _SEEN: set[str] = set()

    def _write(event: str, detail: str = "") -> None:
        with open(_PATH, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "ppid": os.getppid(), "cmd": _CMD,
                                "event": event, "detail": detail}) + "\n")

    def _hook(event: str, args: tuple) -> None:
        if event == "import":
            name = args[0]
            if name in ("torch", "transformers", "uvicorn") and name not in _SEEN:
                _SEEN.add(name)
                _write(f"import {name}")
        elif event == "socket.connect" and "connect" not in _SEEN:
            _SEEN.add("connect")
            _write("first connect", str(args[1]))
        elif event == "socket.bind":
            _write("bind", str(args[1]))
        elif event == "subprocess.Popen":
            _write("spawn", " ".join(str(a) for a in (args[1] or [])[:4]))

    _write("start")
    sys.addaudithook(_hook)
