"""Run the costliest test files first, so that two xdist workers finish together.

``make test`` hands whole files to its workers (``--dist loadscope``: a module's fixtures, such as a run
several tests share, start once) in the order the collection gives them. That order is costliest first,
from the seconds each file took in a measured run (``tests/module_costs.json``): the long end-to-end
files start at once, and the many cheap unit files fill in at the end, where they keep both workers busy
until the last one. A file not in the table counts as its folder's typical cost.

Every run writes what each file took to ``build/test-costs.json``; ``make test-costs`` copies it into the
table after a full run on a quiet machine.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "tests" / "module_costs.json"
MEASURED = REPO / "build" / "test-costs.json"
FOLDER_SECONDS = {"e2e": 40.0, "integration": 8.0, "unit": 0.5}  # a file the table does not list yet


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def expected_seconds(module: str, table: dict[str, float]) -> float:
    if module in table:
        return table[module]
    parts = Path(module).parts
    return FOLDER_SECONDS.get(parts[1] if len(parts) > 1 else "", FOLDER_SECONDS["integration"])


def costliest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: files by their expected seconds, most first; tests keep their order within a
    file, and files of equal cost keep the collection's order."""
    table = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    rank = {}
    for index, item in enumerate(items):
        module = module_of(item.nodeid)
        rank.setdefault(module, (-expected_seconds(module, table), index))
    items.sort(key=lambda item: rank[module_of(item.nodeid)])


class CostRecorder:
    """Sums each file's setup, call and teardown seconds from the reports (on xdist's controller they arrive
    from the workers) and writes them at the end of a run that collected every folder."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[module_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput") or not self.seconds:
            return  # a worker: the controller writes the whole run's figures
        folders = {Path(m).parts[1] for m in self.seconds if len(Path(m).parts) > 1}
        if folders != set(FOLDER_SECONDS):
            return  # a partial run (one folder, one file) is no measure of the whole
        MEASURED.parent.mkdir(exist_ok=True)
        ordered = dict(sorted(((m, round(s, 1)) for m, s in self.seconds.items()), key=lambda kv: -kv[1]))
        MEASURED.write_text(json.dumps(ordered, indent=1) + "\n")
