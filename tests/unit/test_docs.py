"""The documentation's generated reference: every config field is described, and no page is stale.

docs/gen_reference.py renders the CLI, config, control API, metrics and streams pages from the code;
``make docs`` (part of ``make test``) also builds the site with ``mkdocs build --strict``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_field_has_a_description() -> None:
    missing = _generator().undescribed()
    assert not missing, "config fields without description=: " + ", ".join(missing)


def test_the_generated_reference_is_current() -> None:
    gen = _generator()
    pages = gen.render()
    assert set(pages) == {"cli.md", "config.md", "api.md", "metrics.md", "streams.md"}
    stale = [name for name, text in pages.items() if (gen.OUT / name).read_text() != text]
    assert not stale, f"stale reference pages (run `python docs/gen_reference.py`): {stale}"
    config = pages["config.md"]
    for field in ("`total_steps`", "`max_staleness`", "`lr_scheduler`", "`interval_s`"):
        assert field in config
    assert "`--set KEY=VALUE`" in pages["cli.md"] and "`/v1/status`" in pages["api.md"]
    assert "`tandem_weight_version`" in pages["metrics.md"] and "`turns:{agent}`" in pages["streams.md"]
