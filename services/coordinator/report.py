"""End-of-run report: ``runs/<run>/summary.json``, ``metrics.json`` and a reward plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.coordinator.state import RunState


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def quarters(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    q = max(1, len(values) // 4)
    return _mean(values[:q]), _mean(values[-q:])


def build_summary(state: RunState, evals: list[dict[str, Any]]) -> dict[str, Any]:
    agents = {}
    for name, a in state.agents.items():
        first, last = quarters([r for _, r in a.group_rewards])
        agents[name] = {
            "weight_versions": len(a.loaded_weight_versions),
            "last_weight_version": a.loaded_weight_version,
            "steps": len(a.train_steps),
            "reward_first_quarter": first,
            "reward_last_quarter": last,
            "eval_start": a.eval_start,
            "eval_end": a.eval_end,
            "groups_kept": a.kept_groups,
            "groups_dropped": a.dropped_groups,
            "groups_abandoned": a.abandoned_groups,
            "abandon_reasons": dict(a.abandon_reasons),
            "max_staleness": a.max_staleness,
        }
    return {"run": state.cfg.run.name, "phase": state.phase, "error": state.error, "episodes": state.episodes_done,
            "wall_s": None, "agents": agents, "evals": evals}


def write_report(state: RunState, evals: list[dict[str, Any]], out_dir: Path, wall_s: float) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = build_summary(state, evals)
    summary["wall_s"] = round(wall_s, 1)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    metrics = {name: {"train_steps": a.train_steps, "group_rewards": a.group_rewards}
               for name, a in state.agents.items()}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(state, out_dir / "rewards.png")
    return out_dir / "summary.json"


def plot(state: RunState, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    t0 = state.started_at
    for name, a in state.agents.items():
        if a.group_rewards:
            xs = [t - t0 for t, _ in a.group_rewards]
            ys = [r for _, r in a.group_rewards]
            k = max(1, len(ys) // 10)
            smooth = [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]
            axes[0].plot(xs, smooth, label=f"agent {name}")
        steps = a.train_steps
        axes[1].plot([s.get("weight_version", i + 1) for i, s in enumerate(steps)],
                     [s.get("pg_loss", 0.0) for s in steps], label=f"{name} pg loss")
        axes[1].plot([s.get("weight_version", i + 1) for i, s in enumerate(steps)],
                     [s.get("clip_frac", 0.0) for s in steps], "--", label=f"{name} clip frac")
        if a.eval_start is not None and a.eval_end is not None:
            axes[2].bar([f"{name} start", f"{name} end"], [a.eval_start, a.eval_end])
    axes[0].set(title="training reward per group (smoothed)", xlabel="seconds", ylabel="reward")
    axes[1].set(title="train-step metrics", xlabel="weight version")
    axes[2].set(title="eval vs scripted opponent (score)", ylim=(0, 1))
    for ax in axes[:2]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
