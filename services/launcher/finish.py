"""The end of ``tandem up``: the restarts per service into ``summary.json``, the summary printed, the exit code."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from services.launcher.live_view import summary_table
from services.launcher.processes import LOST_EPISODES


def failed_episodes(summary: dict) -> dict[str, int]:
    """Episodes the run lost (an environment bug, a lost turn), per purpose: ``episodes_failed``'s totals."""
    return {purpose: int(per.get("total", 0)) for purpose, per in (summary.get("episodes_failed") or {}).items()
            if int(per.get("total", 0))}


def report(run_dir: Path, code: int, restarts: dict[str, int], console: Console) -> int:
    """Add the restarts per service to ``summary.json`` and print the summary of a finished run. A run that
    finished but lost episodes exits ``LOST_EPISODES`` (4), naming them, so scripts and sweeps see it."""
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        summary["restarts"] = {name: restarts.get(name, 0) for name in sorted(restarts)}
        summary_path.write_text(json.dumps(summary, indent=2))
        if code == 0:
            console.print(summary_table(summary))
            console.print(f"summary: {summary_path}   plot: {run_dir / 'rewards.png'}")
            if lost := failed_episodes(summary):
                console.print(f"[yellow]the run finished but lost episodes: {lost} (summary.json episodes_failed, "
                              f"the coordinator's log says why); exit {LOST_EPISODES}[/yellow]", soft_wrap=True)
                code = LOST_EPISODES
        if code and summary.get("error"):  # the run failed for good: say why (the coordinator's message)
            console.print(f"[red]the run failed: {summary['error']}[/red]", soft_wrap=True)
    if any(restarts.values()):
        console.print("restarts: " + ", ".join(f"{k} {v}" for k, v in sorted(restarts.items()) if v))
    return code
