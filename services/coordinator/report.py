"""End-of-run report (docs/architecture.md §10): ``runs/<run>/summary.json``, ``metrics.json``, a plot and
``config.json`` (the run's config without its secrets, for ``tandem dashboard RUN``).

``summary.json`` holds per agent the training figures, the illegal or format-failure rate of its
training episodes (overall and per weight version, train_play.py) and ``eval_curves``: per
opponent, one point per evaluation (start, every n steps, end) with the score, its standard
error and 95 % Wilson interval, wins/draws/losses, the illegal rate and the means of the environment's
episode summaries (``summary_means``, e.g. guess_number's turns and found rate; evals.py).
``rewards.png`` plots the training reward, the training illegal rate, the eval scores (± standard
error) and the train-step metrics, all against the training step (weight version).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.contracts.config import TandemConfig
from services.coordinator.learning_signal import signal_status
from services.coordinator.state import RunState
from services.coordinator.train_play import curve, totals

CURVE_KEYS = ("score", "score_se", "score_ci95", "wins", "draws", "losses", "episodes", "illegal_rate",
              "illegal_rate_se", "illegal_rate_ci95", "illegal_reply_rate", "summary_means")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def quarters(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    q = max(1, len(values) // 4)
    return _mean(values[:q]), _mean(values[-q:])


def eval_curves(evals: list[dict[str, Any]], agent: str) -> dict[str, list[dict[str, Any]]]:
    """opponent -> one point per evaluation of ``agent`` (by weight version): label, step and the report's
    figures. Entries from before several opponents (only ``details``) count under their opponent."""
    out: dict[str, list[dict[str, Any]]] = {}
    for e in evals:
        vs = (e.get("vs") or {}).get(agent)
        if vs is None and agent in (e.get("details") or {}):
            detail = e["details"][agent]
            opponent = detail.get("opponent", "random")
            vs = {opponent if isinstance(opponent, str) else json.dumps(opponent): detail}
        for opponent, r in (vs or {}).items():
            point = {"label": e.get("label"), "step": (e.get("versions") or {}).get(agent)}
            out.setdefault(opponent, []).append(point | {k: r.get(k) for k in CURVE_KEYS})
    for points in out.values():
        points.sort(key=lambda p: -1 if p["step"] is None else p["step"])
    return out


def build_summary(state: RunState, evals: list[dict[str, Any]]) -> dict[str, Any]:
    agents = {}
    for name, a in state.agents.items():
        first, last = quarters([r for _, r in a.group_rewards])
        play = curve(a.train_play)
        agents[name] = {
            "weight_versions": len(a.loaded_weight_versions),
            "last_weight_version": a.loaded_weight_version,
            # the versions the agent's engines loaded, and those its trainer committed (its signed train log): a
            # version the rollout could not load while its engines were down is passed over for a newer one
            "loaded_versions": sorted(a.loaded_weight_versions),
            "published_versions": sorted(int(t["weight_version"]) for t in a.train_steps),
            "steps": len(a.train_steps),
            "reward_first_quarter": first,
            "reward_last_quarter": last,
            "eval_start": a.eval_start,
            "eval_end": a.eval_end,
            "eval_curves": eval_curves(evals, name),
            "train_illegal_rate": totals(a.train_play).report()["illegal_rate"],
            "train_illegal_rate_last": play[-1]["illegal_rate"] if play else None,
            "signal": signal_status(a.train_steps),
            "signal_per_step": [{k: s.get(k) for k in ("weight_version", "zero_variance_groups", "malformed_rate")}
                                for s in a.train_steps],
            "train_play": play,
            "groups_kept": a.kept_groups,
            "groups_dropped": a.dropped_groups,
            "groups_abandoned": a.abandoned_groups,
            "abandon_reasons": dict(a.abandon_reasons),
            "max_staleness": a.max_staleness,
        }
    return {"run": state.cfg.run.name, "phase": state.phase, "error": state.error, "episodes": state.episodes_done,
            "episodes_failed": state.episodes_failed, "wall_s": None, "agents": agents, "evals": evals}


def saved_config(cfg: TandemConfig) -> dict[str, Any]:
    """The config as the run directory keeps it (``config.json``, read by ``tandem dashboard RUN``): without
    the API token or the Redis URL (which may hold a password)."""
    data = cfg.model_dump(mode="json")
    data["api"]["token"] = ""
    data["redis_url"] = ""
    return data


def write_report(state: RunState, evals: list[dict[str, Any]], out_dir: Path, wall_s: float) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(saved_config(state.cfg), indent=1))
    summary = build_summary(state, evals)
    summary["wall_s"] = round(wall_s, 1)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    metrics = {name: {"train_steps": a.train_steps, "group_rewards": a.group_rewards,
                      "train_play": curve(a.train_play)} for name, a in state.agents.items()}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(state, summary, out_dir / "rewards.png")
    return out_dir / "summary.json"


def plot(state: RunState, summary: dict[str, Any], path: Path) -> None:
    """Four panels, each against the training step: reward, illegal rate, eval scores, train-step metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    (ax_r, ax_i), (ax_e, ax_m) = axes
    for name, a in state.agents.items():
        play = summary["agents"][name]["train_play"]
        if play:
            xs = [p["weight_version"] for p in play]
            ax_r.plot(xs, [p["mean_reward"] for p in play], marker=".", label=f"{name} (episodes)")
            ax_i.plot(xs, [p["illegal_rate"] for p in play], marker=".", label=f"{name} illegal / format failure")
        steps = a.train_steps
        versions = [s.get("weight_version", i + 1) for i, s in enumerate(steps)]
        if not play and steps:
            ax_r.plot(versions, [s.get("reward_mean", 0.0) for s in steps], label=f"{name} (trained batch)")
        ax_m.plot(versions, [s.get("pg_loss", 0.0) for s in steps], label=f"{name} pg loss")
        ax_m.plot(versions, [s.get("clip_frac", 0.0) for s in steps], "--", label=f"{name} clip frac")
        for opponent, points in summary["agents"][name]["eval_curves"].items():
            pts = [p for p in points if p["score"] is not None and p["step"] is not None]
            if pts:
                ax_e.errorbar([p["step"] for p in pts], [p["score"] for p in pts],
                              yerr=[p["score_se"] or 0.0 for p in pts], marker="o", capsize=3,
                              label=f"{name} vs {opponent}")
    ax_r.set(title="training reward per episode", xlabel="training step (weight version)", ylabel="mean reward")
    ax_i.set(title="training episodes with an illegal / malformed reply", xlabel="training step (weight version)",
             ylabel="fraction", ylim=(0, 1))
    ax_e.set(title="held-out eval score (± standard error)", xlabel="training step (weight version)",
             ylabel="score (win 1, draw 1/2)", ylim=(0, 1))
    ax_m.set(title="train-step metrics", xlabel="training step (weight version)")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
