"""A session's timeline as a trace file (``RestClient.export_session_trace``), from the requests it recorded.

Every request a session's clients sent (model operations, sampling, custom losses) is kept in
Redis with when it arrived and when its result was stored. The export writes them as Chrome
trace-event JSON, which Perfetto (ui.perfetto.dev) opens: one track per training run,
sampling session or loss log, one slice per request (``args``: seq_id, state, request_id).
The file lands in ``data_dir/traces`` and is fetched through a signed URL, like external weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRACES = "traces"


def trace_events(session_id: str, requests: list[dict[str, bytes]]) -> dict[str, Any]:
    """The requests as complete ("X") events, each scope a thread of one process named for the session."""
    scopes = sorted({r["scope"].decode() for r in requests})
    tid = {s: i + 1 for i, s in enumerate(scopes)}
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
                                     "args": {"name": f"session {session_id}"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid[s], "args": {"name": s}} for s in scopes]
    for r in sorted(requests, key=lambda r: float(r.get("at", b"0"))):
        start = float(r.get("at", b"0"))
        end = float(r.get("done_at", r.get("at", b"0")))
        scope = r["scope"].decode()
        events.append({"name": r["kind"].decode(), "cat": "request", "ph": "X", "pid": 1, "tid": tid[scope],
                       "ts": round(start * 1e6), "dur": max(round((end - start) * 1e6), 1),
                       "args": {"seq_id": int(r["seq"]), "state": r.get("state", b"").decode(),
                                "request_id": f"{scope}#{int(r['seq'])}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(data_dir: Path, session_id: str, requests: list[dict[str, bytes]]) -> str:
    """Write the session's trace; returns its path relative to the signed-file root (``traces/...``)."""
    out = Path(data_dir) / TRACES
    out.mkdir(parents=True, exist_ok=True)
    name = f"{session_id}.trace.json"
    tmp = out / (name + ".tmp")
    tmp.write_text(json.dumps(trace_events(session_id, requests)))
    tmp.replace(out / name)
    return f"{TRACES}/{name}"
