"""The architecture rule, checked: services never import each other; contracts import no service.

A service is a package under ``services/`` with a ``__main__`` (it runs as its own process).
Libraries (``common``, ``envs``, ``demo``, ``training``, ``inference``) may be imported by any
package; ``contracts`` may import only itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "services"
SERVICES = {p.parent.name for p in ROOT.glob("*/__main__.py")}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {m.split(".")[1] for m in found if m.startswith("services.") and m.count(".") >= 1}


def test_services_never_import_each_other_and_contracts_import_no_service():
    assert {"buffer", "coordinator", "engine", "rollout", "trainer"} <= SERVICES
    problems = []
    for path in ROOT.rglob("*.py"):
        package = path.relative_to(ROOT).parts[0]
        for imported in _imports(path) - {package}:
            if package == "contracts" or imported in SERVICES:
                problems.append(f"{path.relative_to(ROOT.parent)} imports services.{imported}")
    assert not problems, "\n".join(problems)
