"""A run that finishes but lost episodes says so (issue 16 item 4; docs/architecture.md §11): ``summary.json``
counts them (``episodes_failed``) and ``tandem up`` exits ``LOST_EPISODES`` (4), not 0; ``tandem sweep`` keeps
such a sub-run as finished (its report counts what it lost)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from services.launcher.processes import LOST_EPISODES, PERMANENT_EXITS
from services.launcher.up import failed_episodes, report


def summary(tmp_path: Path, failed: dict) -> Path:
    agents = {"A": {"steps": 2, "weight_version": 2, "mean_reward": 0.0}}
    (tmp_path / "summary.json").write_text(json.dumps({"run": "r", "phase": "done", "wall_s": 1.0, "agents": agents,
                                                       "evals": [], "episodes_failed": failed}))
    return tmp_path


def test_a_finished_run_that_lost_episodes_exits_4_naming_them(tmp_path: Path) -> None:
    console = Console(record=True, width=200)
    d = summary(tmp_path, {"train": {"total": 3, "A": 3}, "eval": {"total": 0}})
    assert failed_episodes(json.loads((d / "summary.json").read_text())) == {"train": 3}
    assert report(d, 0, {"coordinator": 0}, console) == LOST_EPISODES
    assert "lost episodes: {'train': 3}" in console.export_text()
    assert LOST_EPISODES not in PERMANENT_EXITS  # a service never exits 4: it is the launcher's own


def test_a_clean_run_exits_0_and_a_failed_one_keeps_its_code(tmp_path: Path) -> None:
    console = Console(record=True, width=200)
    d = summary(tmp_path, {"train": {"total": 0}})
    assert report(d, 0, {}, console) == 0
    (tmp_path / "lost").mkdir()
    lost = summary(tmp_path / "lost", {"train": {"total": 1}})
    assert report(lost, 130, {}, console) == 130  # interrupted: not a finished run, its own code
    assert json.loads((lost / "summary.json").read_text())["restarts"] == {}
