"""Code cites docs/architecture.md by section (``§N``, ``§N.M``): every cited section exists in the doc.

The doc numbers its sections in its headings (``## 3. Trajectories are token-exact``, ``### 2.2 Delivery
rules``). A citation that names a part of its section in quotes (``§3, "Per-turn credit"``) must also find
that part there: a heading or a bold paragraph title (``**Per-turn credit**``). Unit test: it reads files only.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
HEADING = re.compile(r"^#{2,}\s+(\d+(?:\.\d+)*)\.?\s+(.+)$", re.MULTILINE)
CITATION = re.compile(r"§(\d+(?:\.\d+)*)")
NAMED = re.compile(r"§(\d+(?:\.\d+)*),\s*\"([^\"]+)\"")
SUFFIXES = {".py", ".js", ".html", ".md", ".yaml", ".yml", ".toml"}


def sections() -> dict[str, str]:
    """Section number -> its text (heading included, up to the next heading of any level)."""
    text = DOC.read_text()
    heads = list(HEADING.finditer(text))
    return {m.group(1): text[m.start():heads[i + 1].start() if i + 1 < len(heads) else len(text)]
            for i, m in enumerate(heads)}


def sources() -> list[Path]:
    return sorted(p for p in (REPO / "services").rglob("*") if p.is_file() and p.suffix in SUFFIXES)


def test_the_doc_numbers_its_sections() -> None:
    found = sections()
    assert {"1", "2", "2.1", "2.2", "2.3", "3", "10"} <= set(found), sorted(found)


def test_every_cited_section_exists() -> None:
    found = sections()
    wrong = []
    for path in sources():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            wrong += [f"{path.relative_to(REPO)}:{n}: §{s}" for s in CITATION.findall(line) if s not in found]
    assert not wrong, "citations of sections docs/architecture.md does not have:\n" + "\n".join(wrong)
    assert any(CITATION.search(p.read_text(errors="replace")) for p in sources())  # the scan found citations


def test_a_named_part_is_in_its_section() -> None:
    found = sections()
    wrong = []
    for path in sources():
        for number, part in NAMED.findall(path.read_text(errors="replace")):
            body = found.get(number, "")
            if f"**{part}**" not in body and part not in body.split("\n", 1)[0]:
                wrong.append(f"{path.relative_to(REPO)}: §{number}, {part!r}")
    assert not wrong, "citations naming a part their section does not hold:\n" + "\n".join(wrong)
