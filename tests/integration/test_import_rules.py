"""The architecture rule, checked: services never import each other; contracts import no service.

A service is a package under ``services/`` with a ``__main__`` (it runs as its own process).
Libraries (``common``, ``envs``, ``demo``, ``training``, ``inference``) may be imported by any
package; ``contracts`` may import only itself. No module under ``services/`` imports one that imports it
back, directly or through others, within its package or across packages, not even under ``TYPE_CHECKING``
or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "services"
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The ``modules`` that ``path`` imports anywhere in it, with the packages each import runs first (their
    ``__init__``; its own packages excepted: they run before it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
    me = _module_name(path)
    return {m for m in found if m != me and not me.startswith(m + ".")}


def _circles() -> list[str]:
    """The modules under ``services/`` that are on an import circle."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: _imported(path, set(modules)) for name, path in modules.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    return sorted(name for name in graph if reaches(name, name, set()))


def test_no_module_is_on_an_import_circle():
    """No module of any package under ``services/`` imports, even only for type checking, one that imports it back:
    the coordinator's parts (router, players, episodes, evaluations, groups, events) never import the
    ``Coordinator`` that wires them; a shared piece lives in the module both sides import."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert {"common", "coordinator", "launcher", "training"} <= packages
    circles = _circles()
    assert not circles, f"modules on an import circle: {circles}"


# A fresh process imports the coordinator, the buffer and the launcher, then does what the coordinator
# does at start (tokenizers, context windows, a chat turn, TensorBoard's writer): no torch.
NO_TORCH_CHILD = """
import sys
import services.buffer.__main__, services.launcher.cli, services.trainer.__main__
assert "transformers" not in sys.modules, "the buffer, the launcher or the trainer's entry imports transformers"
import services.coordinator.__main__
from services.common.bus import Bus
from services.contracts.config import parse_config
from services.coordinator.scheduler import Coordinator
from services.coordinator.tracking import RunLogger
from services.envs.render import render_user_turn
model, out = sys.argv[1], sys.argv[2]
agent = {"model_path": model}
cfg = parse_config({"run": {"name": "imports", "output_dir": out}, "redis_url": "redis://127.0.0.1:1",
                    "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
                    "agents": {"A": agent, "B": agent}})
coord = Coordinator(cfg, Bus(cfg.redis_url, "imports", "coordinator"))
assert render_user_turn(coord.players.tokenizers["A"], "hello") and coord.players.context["A"] > 0
logger = RunLogger(cfg)
logger.open()
logger.tb.add_scalar("A/train/loss", 0.5, global_step=1)
logger.tb.close()
print("torch" in sys.modules)
"""


def test_coordinator_buffer_and_launcher_start_without_torch(tiny_model_dir: Path, tmp_path: Path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", NO_TORCH_CHILD, str(tiny_model_dir), str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False"], "torch was imported at the coordinator's start"
