"""What ``tandem up`` prints to the terminal: the live table, the evaluation tables, the summary, the log filter.

The live table fits 80 columns with short labelled columns, one row per agent: the step of the run's
total, the recent group reward, the illegal-move rate of its training episodes, the last training step's
malformed-sample rate and zero-variance share, and the latest evaluation's score against its headline
opponent, named. The run's episodes per second and ETA are in the title; each agent's steps per minute,
ETA and weight version, a streak of steps without learning signal, restarts and silent engines are lines
under it. Each evaluation prints once as a small table (agent, opponent, score ± SE, the environment's
measures, illegal rate). ``LogEcho`` shows the services' log lines: all of them, prefixed by service, with
``--verbose``; otherwise only warnings, errors and tracebacks (every line is in ``runs/<run>/logs/`` anyway),
a known harmless third-party warning explained the first time and its repeats left to the logs. A
``status`` here is ``GET /v1/status``'s JSON, a ``RunStatus`` (services/contracts/status.py) that the
launcher has validated.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from services.launcher.progress import Progress, fmt_duration
from services.launcher.restarts import silent_engines

LIVE_COLUMNS = ("agent", "step", "reward", "illegal", "malformed", "zero-var", "eval")
OWN_FORMAT = re.compile(r"^\d\d:\d\d:\d\d (\w+) ")  # the services' "%H:%M:%S LEVEL name: message"
# third-party warnings every run gives, with why they are harmless: said once, the repeats only in the logs
KNOWN_HARMLESS = {
    "accessible without authentication": "the SGLang router warns that it adds engines without an API key; "
                                         "the engines listen on 127.0.0.1 only, and the router itself checks "
                                         "the run's token",
    "Invalid HTTP request received": "an engine's web server (uvicorn) logs the SGLang router's gRPC probe, "
                                     "sent when the router registers the engine to tell HTTP from gRPC apart",
}
SEVERE = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL)\b|\w(Warning|Error|Exception)\b:")


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def headline(status: dict[str, Any], agent: str, label: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """The newest evaluation of ``agent`` (with ``label`` when given) that has a score: (its headline opponent,
    the report)."""
    for ev in reversed(status.get("evals") or []):
        vs = (ev.get("vs") or {}).get(agent) or {}
        opponents = [o for o in [*(ev.get("opponents") or []), *vs] if vs.get(o, {}).get("score") is not None]
        if opponents and label in (None, ev.get("label")):
            return opponents[0], vs[opponents[0]]
    return None


def scored(latest: tuple[str, dict[str, Any]] | None) -> str:
    """``vs OPPONENT 0.83``, or the environment's first measure where win/draw/loss means nothing."""
    if latest is None:
        return "-"
    opponent, report = latest
    means = report.get("summary_means") or {}
    if not report.get("game", True) and means:
        name, value = next(iter(means.items()))
        return f"vs {opponent} {name} {value:.2f}"
    return f"vs {opponent} {report['score']:.2f}"


def agent_lines(status: dict[str, Any], name: str, progress: Progress) -> list[str]:
    """The line under the table for an agent: pace, ETA, weight version, the start evaluation; a streak without
    learning signal on a red line of its own."""
    a, rate = status["agents"][name], progress.steps_per_min(name)
    parts = [f"{name}: {num(rate)} steps/min" if rate is not None else f"{name}: steps/min -",
             f"ETA {fmt_duration(progress.eta_s(name, a['step'], status['total_steps']))}",
             f"weights v{a['weight_version']}"]
    if (start := headline(status, name, "start")) is not None:
        parts.append(f"start {scored(start)}")
    streak = (a.get("signal") or {}).get("no_signal_steps")
    red = [f"[red]{name}: no learning signal in {streak} steps in a row[/red]"] if streak else []
    return [", ".join(parts), *red]


def status_table(status: dict | None, restarts: dict[str, int] | None = None,
                 progress: Progress | None = None) -> Table:
    """The live table (fits 80 columns for the usual agent names and opponents)."""
    progress = progress or Progress()
    if status:
        title = (f"Tandem run {status.get('run')} — {status.get('phase')} — "
                 f"{status.get('episodes_per_s', 0.0):.2f} episodes/s — "
                 f"ETA {fmt_duration(progress.run_eta_s(status))}")
    else:
        title = "Tandem run — starting"
    caption = [line for n in status["agents"] for line in agent_lines(status, n, progress)] if status else []
    restarted = ", ".join(f"{name} {n}" for name, n in sorted((restarts or {}).items()) if n)
    caption += [f"restarts: {restarted}"] if restarted else []
    caption += [f"[red]{line}[/red]" for line in silent_engines(status)]
    table = Table(title=title, caption="\n".join(caption) or None, caption_justify="left")
    for col in LIVE_COLUMNS:
        table.add_column(col, justify="left" if col in ("agent", "eval") else "right")
    for name, a in (status or {}).get("agents", {}).items():
        sig = a.get("signal") or {}
        table.add_row(name, f"{a['step']}/{status['total_steps']}", num(a.get("recent_group_reward"), 3),
                      num(a.get("illegal_rate")), num(sig.get("malformed_rate")),
                      num(sig.get("zero_variance_groups")), scored(headline(status, name)))
    return table


def eval_table(ev: dict[str, Any]) -> Table:
    """One evaluation: a row per agent and opponent with score ± SE (a game), the environment's measures and the
    illegal (or malformed) rate."""
    rows = [(agent, opponent, r) for agent, vs in (ev.get("vs") or {}).items() for opponent, r in vs.items()]
    game = any(r.get("game", True) for _, _, r in rows)
    measures = list(dict.fromkeys(k for _, _, r in rows for k in (r.get("summary_means") or {})))
    versions = ev.get("versions") or {}
    table = Table(title=f"eval {ev.get('label')}", title_justify="left")
    for col in ("agent", "opponent", *(["score ± SE"] if game else ["reward"]), *measures, "illegal"):
        table.add_column(col, justify="left" if col in ("agent", "opponent") else "right")
    for agent, opponent, r in rows:
        name = f"{agent} v{versions[agent]}" if agent in versions else agent
        if game:
            first = "-" if r.get("score") is None else f"{r['score']:.3f} ± {r.get('score_se') or 0.0:.3f}"
        else:
            first = num(r.get("mean_reward"), 3)
        means = r.get("summary_means") or {}
        table.add_row(name, opponent, first, *(num(means.get(k)) for k in measures), num(r.get("illegal_rate")))
    return table


def new_evals(status: dict[str, Any], shown: set[tuple[str, float]]) -> list[dict[str, Any]]:
    """The status's evaluations not printed yet (by label and time), marked printed."""
    fresh = [ev for ev in status.get("evals") or [] if (str(ev.get("label")), ev.get("time") or 0.0) not in shown]
    shown.update((str(ev.get("label")), ev.get("time") or 0.0) for ev in fresh)
    return fresh


def summary_table(summary: dict) -> Table:
    table = Table(title=f"Tandem run {summary['run']} — {summary['phase']} in {summary['wall_s']}s")
    cols = ("weight_versions", "steps", "reward_first_quarter", "reward_last_quarter", "train_illegal_rate",
            "eval_start", "eval_end")
    table.add_column("agent")
    for c in cols:
        table.add_column(c)
    for name, a in summary["agents"].items():
        table.add_row(name, *("-" if a.get(c) is None else (f"{a[c]:.3f}" if isinstance(a[c], float) else str(a[c]))
                              for c in cols))
    return table


def severe(line: str) -> bool:
    """A warning, an error or an exception line: by its level where the line is the services' own format."""
    own = OWN_FORMAT.match(line)
    if own:
        return own.group(1) in ("WARNING", "ERROR", "CRITICAL")
    return bool(SEVERE.search(line))


class LogEcho:
    """The services' log lines on the console, prefixed by service: every line with ``verbose``, else only
    warnings, errors and whole tracebacks (from ``Traceback`` to the exception's line). A known harmless
    warning (``KNOWN_HARMLESS``) is explained the first time; without ``verbose`` its repeats stay in the logs."""

    def __init__(self, console: Console, verbose: bool = False) -> None:
        self.console, self.verbose = console, verbose
        self.lock = threading.Lock()
        self.in_traceback: set[str] = set()
        self.explained: set[str] = set()

    def shown(self, name: str, line: str) -> bool:
        if self.verbose:
            return not (" INFO " in line and "uvicorn" in line)
        if line.startswith("Traceback (most recent call last)"):
            self.in_traceback.add(name)
            return True
        if name in self.in_traceback:
            if not line[:1].isspace():  # the exception's own line ends the traceback
                self.in_traceback.discard(name)
            return True
        return severe(line)

    def known(self, line: str) -> str | None:
        """A known harmless warning: its explanation the first time, "" for a repeat, None for any other line."""
        for text, why in KNOWN_HARMLESS.items():
            if text in line:
                seen = text in self.explained
                self.explained.add(text)
                return "" if seen else why
        return None

    def say(self, name: str, line: str) -> None:
        self.console.print(Text.assemble((f"{name:>13}", "dim"), " │ ", Text.from_ansi(line)), highlight=False,
                           soft_wrap=True)

    def __call__(self, name: str, line: str) -> None:
        with self.lock:
            why = self.known(line)
            if why:  # the first of a known harmless warning, explained
                self.say(name, line)
                self.say("", f"(harmless: {why}; {'repeats follow' if self.verbose else 'repeats only in the logs'})")
            elif (why is None or self.verbose) and self.shown(name, line):
                self.say(name, line)
