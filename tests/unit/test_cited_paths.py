"""Every ``tests/...`` path the repository cites (docs, code, tests, configs, deploy files, Makefile, CI) exists: a
moved or renamed test file leaves no dangling citation. A glob (``tests/*/test_tinker_*.py``) must match a file; a
``module.attribute`` citation (``tests/bench/fsync_cost.demo_run``) must name a module that exists. Unit test: it
reads files only.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where a path of a test file may be cited: the docs, the code, the tests, configs, deploy files, the build and CI.
CITING = ("docs", "services", "tests", "configs", "deploy", "examples", ".ci", "README.md", "Makefile",
          "pyproject.toml", "mkdocs.yml", "docker-compose.yml")
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ""}
CITED = re.compile(r"(?<![\w/.])tests/[\w*./-]*[\w*]")


def _cited_test_paths() -> list[tuple[str, str]]:
    """(where, path) for every ``tests/...`` path the repository's text cites."""
    found = []
    for root in (REPO / name for name in CITING):
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT)
        for path in files:
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                found += [(f"{path.relative_to(REPO)}:{n}", m.group(0)) for m in CITED.finditer(line)]
    return found


def _exists(cited: str) -> bool:
    """A path, a glob, or ``module.attribute`` of a file that exists."""
    module = cited.rsplit(".", 1)[0] + ".py"
    return any(any(REPO.glob(p)) for p in (cited, module) if p)


def test_every_cited_test_path_exists() -> None:
    cited = _cited_test_paths()
    dangling = [f"{where}: {path}" for where, path in cited if not _exists(path)]
    assert not dangling, "cited tests/ paths that do not exist:\n" + "\n".join(dangling)
    assert any(path.startswith("tests/unit/") for _, path in cited)  # the scan found citations
