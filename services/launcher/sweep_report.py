"""The report of a ``tandem sweep`` (services/launcher/sweep.py): one table and one plot across seeds.

Reads each sub-run's ``summary.json`` (the coordinator's report, docs/architecture.md §8). Per set-up,
agent and eval opponent it gives the mean ± standard error across seeds (sample standard deviation
/ √n; none for one seed) of the start eval score, the final one, their difference and, where the
summary has them, the eval and training illegal-move / format-failure rates, and the start and final
means of the environment's episode measures (an eval's ``summary_means``: for guess_number the found
rate and the number of turns, the true score when the reward is shaped). Writes ``sweep.md``,
``sweep.json`` and ``sweep.png`` (eval score against the agent's training step, i.e. its weight
version at the evaluation: mean per set-up and agent with a ±SE band) in the sweep's directory.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.contracts.config import TandemConfig
from services.launcher.runs import read_json

ILLEGAL_KEYS = ("illegal_rate", "illegal_move_rate", "format_failure_rate", "invalid_rate")


@dataclass
class SubRun:
    """One sub-run of a sweep: its set-up, seed, run name, written config and parsed config."""
    setup: str
    seed: int
    name: str
    config_path: Path
    data: dict[str, Any]
    cfg: TandemConfig

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir()


def mean_se(xs: list[float]) -> tuple[float | None, float | None, int]:
    """Mean, standard error (sample sd / √n; None below two values) and count of the finite values."""
    vals = [float(x) for x in xs if isinstance(x, int | float) and math.isfinite(x)]
    if not vals:
        return None, None, 0
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, None, len(vals)
    var = sum((x - m) ** 2 for x in vals) / (len(vals) - 1)
    return m, math.sqrt(var / len(vals)), len(vals)


def _illegal(report: dict[str, Any]) -> float | None:
    for k in ILLEGAL_KEYS:
        if isinstance(report.get(k), int | float):
            return float(report[k])
    return None


def _reports(detail: Any, score: Any, default_opponent: str) -> list[tuple[str, dict[str, Any]]]:
    """(opponent, report) of one agent in one evaluation, whichever shape the summary uses: one report,
    one per opponent (a dict or a list), or only the score."""
    if isinstance(detail, dict) and "score" in detail:
        return [(_opp(detail.get("opponent"), default_opponent), detail)]
    if isinstance(detail, dict) and detail:
        return [(str(k), v) for k, v in detail.items() if isinstance(v, dict) and "score" in v]
    if isinstance(detail, list):
        return [(_opp(v.get("opponent"), default_opponent), v) for v in detail if isinstance(v, dict) and "score" in v]
    if isinstance(score, dict):
        return [(str(k), {"score": v}) for k, v in score.items()]
    return [(default_opponent, {"score": score})] if isinstance(score, int | float) else []


def _opp(value: Any, default: str) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return str(value) if value else default


def eval_points(summary: dict[str, Any], default_opponent: str = "eval") -> list[dict[str, Any]]:
    """Every (agent, opponent) evaluation in a summary: label, step, score, illegal rate, in order."""
    points = []
    for i, ev in enumerate(summary.get("evals") or []):
        scores = ev.get("scores") or {}
        details = ev.get("details") or {}
        for agent in dict.fromkeys([*scores, *details, *(ev.get("vs") or {})]):
            step = (ev.get("steps") or {}).get(agent, (ev.get("versions") or {}).get(agent, 0))
            detail = (ev.get("vs") or {}).get(agent) or details.get(agent)  # "vs": every opponent's report
            for opponent, rep in _reports(detail, scores.get(agent), default_opponent):
                if isinstance(rep.get("score"), int | float):
                    points.append({"index": i, "label": ev.get("label"), "agent": agent, "opponent": opponent,
                                   "step": int(step or 0), "score": float(rep["score"]),
                                   "illegal": _illegal(rep), "episodes": rep.get("episodes"),
                                   "se": rep.get("score_se") if isinstance(rep.get("score_se"), int | float) else None,
                                   "means": rep.get("summary_means") or {}})
    return points


def start_end(points: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (agent, opponent): the start evaluation (label start, else the first) and the final one (the last)."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        by[(p["agent"], p["opponent"])].append(p)
    out = {}
    for key, ps in by.items():
        start = next((p for p in ps if p["label"] == "start"), ps[0])
        out[key] = {"start": start, "end": ps[-1], "curve": [(p["step"], p["score"]) for p in ps]}
    return out


def _fmt(m: float | None, se: float | None) -> str:
    if m is None:
        return "-"
    return f"{m:.3f}" if se is None else f"{m:.3f} ± {se:.3f}"


def aggregate(subs: list[SubRun]) -> dict[str, Any]:
    """Per set-up: its runs (done or not), and one row per agent and opponent with mean ± SE across seeds."""
    setups: dict[str, Any] = {}
    for sub in subs:
        s = setups.setdefault(sub.setup, {"runs": [], "missing": [], "cells": defaultdict(list),
                                          "train": {n: a.train for n, a in sub.cfg.agents.items()}})
        summary = read_json(sub.run_dir / "summary.json")
        if summary.get("phase") != "done" or summary.get("error"):
            s["missing"].append(sub.name)
            continue
        s["runs"].append(sub.name)
        opp = _opp(getattr(sub.cfg.environment.eval, "opponent", None), "eval")
        for (agent, opponent), se in start_end(eval_points(summary, opp)).items():
            a = (summary.get("agents") or {}).get(agent) or {}
            s["cells"][(agent, opponent)].append({"seed": sub.seed, "start": se["start"]["score"],
                                                  "end": se["end"]["score"], "end_step": se["end"]["step"],
                                                  "start_se": se["start"].get("se"), "end_se": se["end"].get("se"),
                                                  "illegal": se["end"]["illegal"],
                                                  "start_means": se["start"].get("means") or {},
                                                  "end_means": se["end"].get("means") or {},
                                                  "train_illegal": a.get("train_illegal_rate", _illegal(a)),
                                                  "curve": se["curve"]})
    return {name: {"runs": s["runs"], "missing": s["missing"],
                   "rows": [_row(agent, opp, s["train"].get(agent, True), cells)
                            for (agent, opp), cells in s["cells"].items()]} for name, s in setups.items()}


def _row(agent: str, opponent: str, trains: bool, cells: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"agent": agent, "opponent": opponent, "trains": trains, "seeds": [c["seed"] for c in cells]}
    for key in ("start", "end", "illegal", "train_illegal"):
        m, se, n = mean_se([c[key] for c in cells])
        row[key] = {"mean": m, "se": se, "n": n}
    m, se, n = mean_se([c["end"] - c["start"] for c in cells])
    row["gain"] = {"mean": m, "se": se, "n": n}
    row["end_step"] = max(c["end_step"] for c in cells)
    row["summary_means"] = _measures(cells)
    row["per_seed"] = [{**{k: c.get(k) for k in ("seed", "start", "end", "start_se", "end_se", "illegal")},
                        "gain_in_se": gain_in_se(c)} for c in cells]
    row["curves"] = {str(c["seed"]): c["curve"] for c in cells}
    return row




def gain_in_se(cell: dict[str, Any]) -> float | None:
    """One seed's final − start in standard errors of that difference (the two evaluations' own SEs, taken as
    independent); None without both SEs, inf when both are 0 and the score rose."""
    s, e = cell.get("start_se"), cell.get("end_se")
    if s is None or e is None:
        return None
    diff, se = cell["end"] - cell["start"], math.hypot(s, e)
    return diff / se if se > 0 else (math.inf if diff > 0 else 0.0)


def _measures(cells: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per episode measure every seed's start and final evaluations report: start and final mean ± SE."""
    keys = [k for k in cells[0].get("end_means", {})
            if all(k in c.get("end_means", {}) and k in c.get("start_means", {}) for c in cells)]
    out = {}
    for k in keys:
        (sm, sse, _), (em, ese, n) = (mean_se([c[f"{w}_means"][k] for c in cells]) for w in ("start", "end"))
        out[k] = {"start": {"mean": sm, "se": sse}, "end": {"mean": em, "se": ese}, "n": n}
    return out


COLS = ("set-up", "agent", "opponent", "seeds", "step", "start", "final", "final − start", "eval illegal",
        "train illegal")


def markdown(agg: dict[str, Any], title: str) -> str:
    lines = [f"# {title}", "", "Mean ± standard error across seeds (sample sd / √n).", "",
             "| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    for name, s in agg.items():
        for r in s["rows"]:
            agent = r["agent"] + ("" if r["trains"] else " (frozen)")
            cells = [name, agent, r["opponent"], str(len(r["seeds"])), str(r["end_step"]),
                     *(_fmt(r[k]["mean"], r[k]["se"]) for k in ("start", "end", "gain", "illegal", "train_illegal"))]
            lines.append("| " + " | ".join(cells) + " |")
        if s["missing"]:
            lines.append(f"| {name} | missing: {', '.join(s['missing'])} |" + " |" * (len(COLS) - 2))
    return "\n".join(lines + _per_seed_table(agg) + _measures_table(agg)) + "\n"


def _per_seed_table(agg: dict[str, Any]) -> list[str]:
    """Each seed's start and final score ± its evaluation's SE, and the gain in SEs of the difference."""
    rows = [(name, r, c) for name, s in agg.items() for r in s["rows"] if r["trains"] for c in r["per_seed"]]
    if not any(c.get("gain_in_se") is not None for _, _, c in rows):
        return []
    lines = ["", "Per seed: each evaluation's score ± its own SE (over its episodes), and final − start in SEs "
             "of the difference.", "", "| set-up | agent | opponent | seed | start | final | gain / SE |",
             "|---|---|---|---|---|---|---|"]
    for name, r, c in rows:
        z = c.get("gain_in_se")
        lines.append(f"| {name} | {r['agent']} | {r['opponent']} | {c['seed']} | {_fmt(c['start'], c['start_se'])} | "
                     f"{_fmt(c['end'], c['end_se'])} | {'-' if z is None else f'{z:.1f}'} |")
    return lines


def _measures_table(agg: dict[str, Any]) -> list[str]:
    """The episode measures' table (start and final mean ± SE across seeds), when any row has them."""
    rows = [(name, r, k, v) for name, s in agg.items() for r in s["rows"]
            for k, v in (r.get("summary_means") or {}).items()]
    if not rows:
        return []
    lines = ["", "Episode measures of the evaluations (``summary_means``), mean ± SE across seeds.", "",
             "| set-up | agent | opponent | measure | start | final |", "|---|---|---|---|---|---|"]
    for name, r, k, v in rows:
        lines.append(f"| {name} | {r['agent']} | {r['opponent']} | {k} | "
                     f"{_fmt(v['start']['mean'], v['start']['se'])} | {_fmt(v['end']['mean'], v['end']['se'])} |")
    return lines


def plot(agg: dict[str, Any], path: Path, title: str) -> None:
    """Eval score against training step: per set-up and training agent the mean across seeds, ±SE band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opponents = sorted({r["opponent"] for s in agg.values() for r in s["rows"]}) or ["eval"]
    fig, axes = plt.subplots(1, len(opponents), figsize=(6.5 * len(opponents), 4.5), squeeze=False)
    for ax, opp in zip(axes[0], opponents, strict=True):
        for name, s in agg.items():
            for r in (r for r in s["rows"] if r["opponent"] == opp and r["trains"]):
                by_step: dict[int, list[float]] = defaultdict(list)
                for curve in r["curves"].values():
                    for step, score in curve:
                        by_step[step].append(score)
                xs = sorted(by_step)
                stats = [mean_se(by_step[x]) for x in xs]
                ms = [m or 0.0 for m, _, _ in stats]
                ses = [se or 0.0 for _, se, _ in stats]
                line = ax.plot(xs, ms, marker="o", label=f"{name} · {r['agent']} (n={len(r['seeds'])})")[0]
                ax.fill_between(xs, [m - e for m, e in zip(ms, ses, strict=True)],
                                [m + e for m, e in zip(ms, ses, strict=True)], color=line.get_color(), alpha=0.2)
        ax.set(title=f"eval vs {opp}", xlabel="training step (weight version)", ylabel="score", ylim=(0, 1))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(subs: list[SubRun], out: Path, name: str) -> tuple[Path, Path, Path]:
    """``sweep.md``, ``sweep.json`` and ``sweep.png`` in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(subs)
    title = f"Sweep {name}: seeds {sorted({s.seed for s in subs})}"
    md, js, png = out / "sweep.md", out / "sweep.json", out / "sweep.png"
    md.write_text(markdown(agg, title))
    js.write_text(json.dumps({"sweep": name, "seeds": sorted({s.seed for s in subs}), "setups": agg}, indent=1))
    plot(agg, png, title)
    return md, js, png
