"""The hop table of docs/architecture.md ("The life of a sample") matches the code: every
``services/...py:Name`` or ``services/...py:Class.method`` it cites names a file that exists and a top-level
function or class (or a method of that class) defined in it, and every stream or key it carries a sample on is
one ``services/contracts/streams.py`` builds or the key table (``services/contracts/keys.py``) lists. Unit test:
it reads files only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from services.contracts.keys import KEYS

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
TITLE = "The life of a sample"
REFERENCE = re.compile(r"(services/[\w/]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
TICKED = re.compile(r"`([^`]+)`")
HTTP = re.compile(r"^(GET|POST) /")


def section() -> str:
    """The text of the section titled TITLE, up to the next heading of any level."""
    text = DOC.read_text()
    start = re.search(rf"^#{{2,}}\s+[\d.]*\s*{TITLE}\s*$", text, re.MULTILINE)
    assert start is not None, f"docs/architecture.md has no section {TITLE!r}"
    end = re.compile(r"^#{2,}\s", re.MULTILINE).search(text, start.end())
    return text[start.start():end.start() if end else len(text)]


def rows() -> list[list[str]]:
    """The hop table's body rows, split into cells (the header and its rule left out)."""
    lines = [ln for ln in section().splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def defined(path: Path) -> set[str]:
    """``Name`` for each top-level function and class of the module, ``Class.method`` for each method."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            methods = (f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef))
            names |= {f"{node.name}.{f.name}" for f in methods}
    return names


def declared_names() -> set[str]:
    """Every name ``Streams`` builds under ``tandem:{run}:`` (``turns:{agent}``), and the key table's names."""
    names = {k.name for k in KEYS.values()}
    tree = ast.parse((REPO / "services" / "contracts" / "streams.py").read_text())
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "key":
            arg = call.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
            elif isinstance(arg, ast.JoinedStr):
                names.add("".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                                  for v in arg.values))
    return names


def test_the_table_has_a_row_per_hop() -> None:
    table = rows()
    assert len(table) >= 15, f"the hop table has {len(table)} rows"
    assert [r[0] for r in table] == [str(i) for i in range(1, len(table) + 1)]  # hops numbered in order
    assert all(len(r) == 6 for r in table), [r[0] for r in table if len(r) != 6]


def test_every_cited_function_exists() -> None:
    cited = REFERENCE.findall(section())
    wrong = []
    for file, name in cited:
        path = REPO / file
        if not path.is_file():
            wrong.append(f"{file}: no such file")
        elif name not in defined(path):
            wrong.append(f"{file}:{name}: not defined there")
    assert not wrong, "the hop table cites what the code does not have:\n" + "\n".join(wrong)
    assert len(cited) >= 30  # the scan found the table's citations


def test_every_stream_and_key_is_declared() -> None:
    declared = declared_names()
    carried = [t for r in rows() for t in TICKED.findall(r[3]) if not HTTP.match(t)]
    wrong = sorted({t for t in carried if t not in declared})
    assert not wrong, f"streams or keys the hop table names that services/contracts does not declare: {wrong}"
    assert {"turns:{agent}", "samples:{agent}", "weights:{agent}", "state:{agent}:loaded_version"} <= set(carried)


def test_the_check_catches_a_wrong_name() -> None:
    """The checks above are not vacuous: a method that is not there and a key that is not declared are caught."""
    assert "TurnRouter.on_reply" in defined(REPO / "services" / "coordinator" / "router.py")
    assert "TurnRouter.no_such_method" not in defined(REPO / "services" / "coordinator" / "router.py")
    assert "state:{agent}:no_such_key" not in declared_names()
