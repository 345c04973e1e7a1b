"""What the dashboard page shows, read in the browser for tests/e2e/test_dashboard_browser.py: each chart's title,
tooltip and axes (tick labels as drawn, their measured widths, the room uPlot gave them, the x scale), and
full-page screenshots at a given width."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"

CHARTS_JS = """
const ctx = document.createElement("canvas").getContext("2d");
ctx.font = AXIS_FONT;
const dpr = window.devicePixelRatio || 1;
const out = [];
for (const [key, c] of Object.entries(TandemCharts.charts)) {
  if (c.el.hidden) continue;
  const u = c.plot;
  const axis = a => ({labels: (a._values || []).map(v => (v == null ? "" : String(v))), splits: a._splits || [],
    size: a._size, widths: (a._values || []).map(v => ctx.measureText(v == null ? "" : String(v)).width)});
  const x = axis(u.axes[0]), y = axis(u.axes[1]);
  const left = u.bbox.left / dpr;
  x.pos = x.splits.map(v => left + u.valToPos(v, "x"));
  const h = c.el.querySelector("h4");
  out.push({key, metric: c.el.dataset.metric, title: h.textContent, tooltip: h.title, width: u.width,
            x_min: u.scales.x.min, x_max: u.scales.x.max, x, y, tick: TICK, gap: GAP});
}
return out;
"""


def charts(driver: Any) -> list[dict[str, Any]]:
    """Every shown chart, as the page drew it."""
    return driver.execute_script(CHARTS_JS)


def axis_problems(chart: dict[str, Any]) -> list[str]:
    """A tick label cut off (wider than its axis, or past the canvas edge) or two ticks reading the same."""
    key, problems = chart["key"], []
    for name in ("x", "y"):
        shown = [t for t in chart[name]["labels"] if t]
        if len(set(shown)) != len(shown):
            problems.append(f"{key}: duplicate {name} tick labels {shown}")
    room = chart["y"]["size"] - chart["tick"] - chart["gap"]
    for label, w in zip(chart["y"]["labels"], chart["y"]["widths"], strict=True):
        if w > room + 0.5:
            problems.append(f"{key}: y label {label!r} is {w:.0f} px wide, the axis leaves {room:.0f} px")
    for label, w, at in zip(chart["x"]["labels"], chart["x"]["widths"], chart["x"]["pos"], strict=True):
        if label and (at - w / 2 < -0.5 or at + w / 2 > chart["width"] + 0.5):
            problems.append(f"{key}: x label {label!r} at {at:.0f} px runs past the {chart['width']} px canvas")
    return problems


def title_problems(chart: dict[str, Any]) -> list[str]:
    """A title that is only the raw metric name, or a tooltip that does not give that name."""
    key, title, metric = chart["key"], chart["title"], chart["metric"]
    raw = metric.rsplit("/", 1)[-1]
    problems = []
    if not title or "_" in title or title.strip().lower() == raw.lower():
        problems.append(f"{key}: title {title!r} is not a human title for {metric!r}")
    if raw not in chart["tooltip"] and key not in ("reward",):
        problems.append(f"{key}: tooltip {chart['tooltip']!r} does not name the metric {raw!r}")
    return problems


def screenshot(driver: Any, width: int, name: str) -> Path:
    """The whole page at ``width`` CSS px, saved as build/<name> (the window grows to the page's height)."""
    BUILD.mkdir(exist_ok=True)
    driver.set_window_size(width, 1200)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(int(height) + 140, 6000))
    path = BUILD / name
    driver.save_screenshot(str(path))
    return path
