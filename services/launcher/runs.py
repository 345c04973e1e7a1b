"""Runs on disk: ``tandem runs`` lists them, ``tandem compare RUN RUN…`` compares their curves.

A run directory (``run.output_dir/<run>``) holds, once the run has ended, the coordinator's report:
``summary.json`` (phase, per-agent figures, evaluations) and ``metrics.json`` (per agent the train
steps and the reward of every group, with its time). A directory without a summary is a run still
going (its service logs changed within ``ACTIVE_S``) or one that ended without a report.
``compare`` writes one PNG (training reward per group against the training step, smoothed: the groups
emitted while step k was the latest trained one are spread over [k, k + 1); and the eval score at each
weight version, per run and agent) and one Markdown table of the key figures. ``tandem dashboard RUN``
serves a finished run's dashboard, read-only, from its files (the coordinator's dashboard process).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACTIVE_S = 120.0


@dataclass
class RunInfo:
    name: str
    path: Path
    status: str  # done | stopped | failed | running | incomplete
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    modified: float = 0.0

    def figures(self) -> list[dict[str, Any]]:
        """One row per agent: steps, reward first/last quarter, eval start/end."""
        rows = []
        for agent, a in (self.summary.get("agents") or {}).items():
            rows.append({"run": self.name, "agent": agent, "status": self.status, "steps": a.get("steps"),
                         "reward_first_quarter": a.get("reward_first_quarter"),
                         "reward_last_quarter": a.get("reward_last_quarter"),
                         "eval_start": a.get("eval_start"), "eval_end": a.get("eval_end"),
                         "episodes": self.summary.get("episodes"), "wall_s": self.summary.get("wall_s")})
        return rows or [{"run": self.name, "agent": "-", "status": self.status}]


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _newest(path: Path) -> float:
    times = [p.stat().st_mtime for p in path.rglob("*") if p.is_file() and "redis" not in p.parts]
    return max(times, default=path.stat().st_mtime)


def load_run(path: Path) -> RunInfo:
    summary = read_json(path / "summary.json")
    modified = _newest(path)
    if summary:
        status = "failed" if summary.get("error") else str(summary.get("phase", "done"))
    else:
        status = "running" if time.time() - modified < ACTIVE_S else "incomplete"
    return RunInfo(path.name, path, status, summary, read_json(path / "metrics.json"), modified)


def list_runs(output_dir: Path) -> list[RunInfo]:
    """Every run directory under ``output_dir``, newest first."""
    if not output_dir.is_dir():
        return []
    runs = [load_run(p) for p in output_dir.iterdir() if p.is_dir() and p.name != "compare"
            and ((p / "summary.json").exists() or (p / "logs").is_dir())]
    return sorted(runs, key=lambda r: r.modified, reverse=True)


def resolve(run: str, output_dir: Path) -> RunInfo:
    """A run by name under ``output_dir`` or by its directory; a missing one is a ValueError naming it."""
    path = Path(run)
    if not (path / "summary.json").exists() and not (path / "metrics.json").exists():
        path = output_dir / run
    if not (path / "summary.json").exists() and not (path / "metrics.json").exists():
        raise ValueError(f"no run {run!r}: neither {run}/summary.json nor {output_dir / run}/summary.json exists "
                         "(a run writes its report when it ends)")
    return load_run(path)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


COLUMNS = ("run", "agent", "status", "steps", "reward_first_quarter", "reward_last_quarter", "eval_start",
           "eval_end", "episodes", "wall_s")


def markdown_table(runs: list[RunInfo]) -> str:
    rows = [r for run in runs for r in run.figures()]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _smooth(ys: list[float]) -> list[float]:
    k = max(1, len(ys) // 10)
    return [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]


def group_steps(rewards: list[Any], train_steps: list[dict[str, Any]]) -> list[float]:
    """Each group's place on the training-step axis: the groups emitted while step k was the latest trained one
    (0 before the first) are spread evenly over [k, k + 1) in their order (the dashboard's chart does the same)."""
    done = sorted((float(s["time"]), int(s["weight_version"])) for s in train_steps
                  if isinstance(s.get("time"), int | float) and isinstance(s.get("weight_version"), int))
    times = [t for t, _ in done]
    ks = [done[i - 1][1] if (i := bisect.bisect_right(times, float(t))) else 0 for t, _ in rewards]
    counts, seen, out = Counter(ks), Counter(), []
    for k in ks:
        out.append(k + seen[k] / counts[k])
        seen[k] += 1
    return out


def eval_curve(summary: dict[str, Any], agent: str) -> tuple[list[int], list[float]]:
    """(weight version, score) of every evaluation of ``agent`` that has a score."""
    xs, ys = [], []
    for e in summary.get("evals") or []:
        score = (e.get("scores") or {}).get(agent)
        if isinstance(score, int | float):
            xs.append(int((e.get("versions") or {}).get(agent, 0)))
            ys.append(float(score))
    return xs, ys


def plot_compare(runs: list[RunInfo], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(13, 4.5))
    for run in runs:
        for agent, m in run.metrics.items():
            rewards = m.get("group_rewards") or []
            if rewards:
                ax_r.plot(group_steps(rewards, m.get("train_steps") or []), _smooth([r for _, r in rewards]),
                          label=f"{run.name} · {agent}")
            xs, ys = eval_curve(run.summary, agent)
            if xs:
                ax_e.plot(xs, ys, marker="o", label=f"{run.name} · {agent}")
    ax_r.set(title="training reward per group (smoothed)", xlabel="training step (when the group was emitted)",
             ylabel="reward")
    ax_e.set(title="held-out eval score", xlabel="weight version", ylabel="score", ylim=(0, 1))
    for ax in (ax_r, ax_e):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def compare(names: list[str], output_dir: Path, out: Path) -> tuple[Path, Path]:
    """Write ``compare.png`` and ``compare.md`` into ``out``; return their paths."""
    if len(names) < 2:
        raise ValueError("compare needs at least two runs")
    runs = [resolve(n, output_dir) for n in names]
    out.mkdir(parents=True, exist_ok=True)
    png, table = out / "compare.png", out / "compare.md"
    plot_compare(runs, png)
    table.write_text(f"# Runs compared: {', '.join(r.name for r in runs)}\n\n" + markdown_table(runs))
    return png, table


def runs_table(runs: list[RunInfo]) -> Any:
    """A rich table of runs: one row per run and agent."""
    from rich.table import Table

    table = Table(title=f"{len(runs)} run(s), newest first")
    for c in COLUMNS:
        table.add_column(c)
    for run in runs:
        for r in run.figures():
            table.add_row(*(_fmt(r.get(c)) for c in COLUMNS))
    return table


def add_run_commands(sub: argparse._SubParsersAction) -> None:
    """``tandem runs`` and ``tandem compare`` on the CLI's subparsers."""
    where = "the runs' directory (default: run.output_dir of --config, else runs)"
    p_runs = sub.add_parser("runs", help="list the runs under run.output_dir with status and key figures")
    p_cmp = sub.add_parser("compare", help="compare runs' eval and reward curves: one PNG and one table")
    p_cmp.add_argument("run", nargs="+", help="run names under the runs' directory, or run directories")
    p_cmp.add_argument("--out", default=None, help="where compare.png and compare.md go (default DIR/compare)")
    p_dash = sub.add_parser("dashboard", help="serve a finished run's dashboard, read-only, from its files")
    p_dash.add_argument("run", help="a run name under the runs' directory, or a run directory")
    p_dash.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    p_dash.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    p_dash.add_argument("--run-config", default=None,
                        help="the run's config file, for a run directory without config.json (older runs)")
    for p in (p_runs, p_cmp, p_dash):
        p.add_argument("--dir", default=None, help=where)
        p.add_argument("--config", default=None, help="a run config: its run.output_dir is the runs' directory")


def dashboard_command(args: argparse.Namespace) -> int:
    """``tandem dashboard RUN``: becomes the coordinator's read-only dashboard process for the run's directory
    (services/coordinator/dashboard/finished.py; services do not import each other)."""
    from services.contracts.config import ConfigError, load_config

    try:
        output_dir = Path(args.dir or (load_config(args.config).run.output_dir if args.config else "runs"))
        run = resolve(args.run, output_dir)
    except (ConfigError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", "services.coordinator.dashboard", str(run.path), "--port", str(args.port),
            "--host", args.host] + (["--run-config", args.run_config] if args.run_config else [])
    os.execv(sys.executable, argv)
    return 0  # not reached


def run_command(args: argparse.Namespace) -> int:
    """Run ``tandem runs`` / ``tandem compare``; 2 with a message for a bad config or a missing run."""
    from rich.console import Console

    from services.contracts.config import ConfigError, load_config

    console = Console()
    try:
        output_dir = Path(args.dir or (load_config(args.config).run.output_dir if args.config else "runs"))
        if args.command == "runs":
            runs = list_runs(output_dir)
            console.print(runs_table(runs) if runs else f"no runs under {output_dir}")
            return 0
        png, table = compare(args.run, output_dir, Path(args.out) if args.out else output_dir / "compare")
    except (ConfigError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    console.print(f"plot: {png}\ntable: {table}")
    console.print(table.read_text(), markup=False, highlight=False)
    return 0
