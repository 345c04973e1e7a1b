"""Experiment logging researchers already use: TensorBoard event files and, optionally, Weights & Biases.

``RunLogger`` writes what the coordinator already aggregates from the events stream and its own
episodes: per agent the train-step metrics, the training reward of the groups that finished at each
step (mean, min, max, count), the held-out eval per opponent (score, standard error, wins / draws /
losses, illegal rate), the illegal or format-failure rate of its training episodes, the pipeline
(queue depth, in-flight turns, groups kept / dropped / in flight, loaded weight version), and every
``logging.text_every``-th episode's transcript as text (docs/architecture.md §10). Every scalar has
one step axis, the agent's training step (its weight version): a train step at the version it made, an
evaluation at the version it scored, a group and a pipeline sample at the newest version trained when
they happened (with the wall time they were taken as TensorBoard's wall time). TensorBoard tags are
``<agent>/<section>/<name>`` (``A/train/pg_loss``, ``A/reward/group_mean``, ``A/eval_minimax/score``,
``A/play/illegal_rate``, ``A/pipeline/queue_depth``); W&B gets the same keys, with
``<agent>/<section>/weight_version`` as each section's step. ``follow`` runs beside the coordinator and hands what
is new to ``on_train_step``, ``on_group_reward``, ``on_eval``, ``on_play``, ``on_episode`` and
``on_pipeline`` every ``logging.interval_s``; ``close`` writes what is left and flushes. The writes
run off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from services.common.extras import require
from services.contracts.config import TandemConfig

log = logging.getLogger("tandem.tracking")
PIPELINE_KEYS = ("queue_depth", "inflight", "capacity", "waiting")


class Followed(Protocol):
    """What ``follow`` reads off the coordinator (its run state, evals and recent episodes)."""

    state: Any
    evals: list[dict[str, Any]]
    episodes: dict[str, dict[str, Any]]


@dataclass
class Batch:
    """What is new since the last write."""

    steps: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    rewards: list[tuple[str, int, dict[str, float]]] = field(default_factory=list)  # agent, step, group rewards
    evals: list[dict[str, Any]] = field(default_factory=list)
    episodes: list[dict[str, Any]] = field(default_factory=list)
    pipeline: dict[str, tuple[int, dict[str, float]]] = field(default_factory=dict)  # agent: step, values
    play: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)  # agent, version, counts report


def numeric(data: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics dict (booleans and strings dropped)."""
    return {k: float(v) for k, v in data.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def trained_version_at(steps: list[dict[str, Any]], at: float) -> int:
    """The newest weight version trained at time ``at`` (steps rebuilt after a restart have no time: earlier)."""
    done = [int(s["weight_version"]) for s in steps
            if isinstance(s.get("weight_version"), int) and (s.get("time") is None or s["time"] <= at)]
    return max(done, default=0)


def reward_figures(rewards: list[float]) -> dict[str, float]:
    return {"group_mean": sum(rewards) / len(rewards), "group_min": min(rewards), "group_max": max(rewards),
            "groups": float(len(rewards))}


def transcript_markdown(rec: dict[str, Any]) -> str:
    """An episode as a Markdown table (TensorBoard's text plugin renders Markdown)."""
    rows = [f"**{rec.get('purpose')} episode {rec.get('id')}** (group {rec.get('group_id')}), "
            f"roles {rec.get('roles')}, final rewards {rec.get('rewards')}", "",
            "| turn | role | player | reply | weight version | turn rewards |", "|---|---|---|---|---|---|"]
    for t in rec.get("turns", []):
        text = str(t.get("text", "")).replace("|", "\\|").replace("\n", " ")[:400]
        rows.append(f"| {t.get('turn')} | {t.get('role')} | {t.get('agent')} | `{text}` | "
                    f"{t.get('weight_version', '-')} | {t.get('turn_rewards') or ''} |")
    return "\n".join(rows)


class RunLogger:
    """TensorBoard (``logging.tensorboard``) and W&B (``logging.wandb``) writers for one run."""

    def __init__(self, cfg: TandemConfig, run_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.opts = cfg.logging
        self.dir = Path(run_dir) if run_dir is not None else cfg.run_dir()
        self.tb: Any = None
        self.wandb: Any = None
        self.opened = False
        self.closed = False
        self.cursors: dict[str, int] = {}
        self.episodes_seen = 0
        self.steps_seen: dict[str, int] = {}
        self.group_rewards: dict[str, dict[int, list[float]]] = {}  # agent: step -> rewards not yet written
        self.lock = threading.Lock()  # one write at a time (the follower's and the final one)

    # --- writers --------------------------------------------------------------
    def open(self) -> None:
        """Create the writers (once): TensorBoard's event files, a W&B run (offline needs no network)."""
        if self.opened:
            return
        self.opened = True
        if self.opts.tensorboard:
            from services.coordinator.tb_writer import SummaryWriter  # torch-free

            self.tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"), flush_secs=10)
        if self.opts.wandb is not None and self.opts.wandb.mode != "disabled":
            require("wandb", "logging.wandb")
            import wandb

            (self.dir / "wandb").mkdir(parents=True, exist_ok=True)
            w = self.opts.wandb
            self.wandb = wandb.init(project=w.project, entity=w.entity, mode=w.mode, dir=str(self.dir),
                                    name=self.cfg.run.name, config=self.cfg.model_dump(mode="json"),
                                    settings=wandb.Settings(console="off", silent=True))
            for agent in self.cfg.agents:
                opponents = [f"eval_{o}" for o in self._opponents()]
                for section in ("train", "reward", "play", "pipeline", *opponents):
                    self.wandb.define_metric(f"{agent}/{section}/weight_version")
                    self.wandb.define_metric(f"{agent}/{section}/*", step_metric=f"{agent}/{section}/weight_version")

    def _opponents(self) -> list[str]:
        from services.play.evaluation import opponent_label

        return [opponent_label(o) for o in self.cfg.environment.eval.opponent_list()]

    def _scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        """``values`` under ``prefix`` at training step ``step`` (the agent's weight version)."""
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{prefix}/{k}", v, global_step=step)
        if self.wandb is not None and values:
            self.wandb.log({f"{prefix}/{k}": v for k, v in values.items()} | {f"{prefix}/weight_version": step})

    # --- what is logged -------------------------------------------------------
    def on_train_step(self, agent: str, metrics: dict[str, Any]) -> None:
        """One train_step event's metrics, at the weight version it produced."""
        values = numeric(metrics)
        self.steps_seen[agent] = self.steps_seen.get(agent, 0) + 1
        step = int(values.pop("weight_version", self.steps_seen[agent]))  # without a version: its count
        values.pop("time", None)
        self._scalars(f"{agent}/train", values, step)

    def on_group_rewards(self, agent: str, step: int, figures: dict[str, float]) -> None:
        """The training groups that finished while ``step`` was the agent's newest version: their mean
        reward's mean, min and max, and how many there were."""
        self._scalars(f"{agent}/reward", figures, step)

    def on_eval(self, entry: dict[str, Any]) -> None:
        """One held-out evaluation (start, every n steps, end or on demand), per agent and opponent, at the
        weight version it scored."""
        for agent, per_opponent in (entry.get("vs") or {}).items():
            step = int(entry.get("versions", {}).get(agent, 0))
            for opponent, report in per_opponent.items():
                self._scalars(f"{agent}/eval_{opponent}", numeric({k: report.get(k) for k in (
                    "score", "score_se", "wins", "draws", "losses", "illegal_rate", "mean_reward")}), step)

    def on_play(self, agent: str, version: int, report: dict[str, Any]) -> None:
        """The training episodes generated at one weight version: illegal / format-failure rates, reward."""
        self._scalars(f"{agent}/play", numeric({k: report.get(k) for k in (
            "illegal_rate", "illegal_reply_rate", "mean_reward", "episodes")}), version)

    def on_episode(self, record: dict[str, Any]) -> None:
        """Every ``text_every``-th episode's transcript goes to TensorBoard as text."""
        self.episodes_seen += 1
        every = self.opts.text_every
        if self.tb is not None and every and (self.episodes_seen - 1) % every == 0:
            self.tb.add_text(f"transcripts/{record.get('purpose', 'train')}", transcript_markdown(record),
                             global_step=self.episodes_seen)

    def on_pipeline(self, agent: str, values: dict[str, float], step: int) -> None:
        """The pipeline now, at the agent's newest trained version (TensorBoard's wall time says when)."""
        self._scalars(f"{agent}/pipeline", values, step)

    # --- following the coordinator --------------------------------------------
    def _new(self, key: str, items: list[Any]) -> list[tuple[int, Any]]:
        start = self.cursors.get(key, 0)
        self.cursors[key] = len(items)
        return list(enumerate(items[start:], start=start + 1))

    def collect(self, coord: Followed, final: bool = False) -> Batch:
        """What is new in the coordinator's state (run on the event loop: it only copies)."""
        batch = Batch()
        now = time.time()
        for name, a in coord.state.agents.items():
            batch.steps += [(name, rec) for _, rec in self._new(f"steps/{name}", a.train_steps)]
            batch.rewards += self._rewards(name, a.train_steps, a.group_rewards, final)
            pipe = numeric({k: a.rollout.get(k) for k in PIPELINE_KEYS})
            pipe.update(weight_version=a.loaded_weight_version, groups_kept=a.kept_groups,
                        groups_dropped=a.dropped_groups, groups_in_flight=a.in_flight_groups)
            batch.pipeline[name] = (trained_version_at(a.train_steps, now), pipe)
            done = self.cursors.get(f"play/{name}", -1)  # a version is written once a newer one exists
            versions = sorted(v for v in a.train_play if v > done)
            ready = versions if final else versions[:-1]
            batch.play += [(name, v, a.train_play[v].report()) for v in ready]
            if ready:
                self.cursors[f"play/{name}"] = ready[-1]
        batch.evals = [e for _, e in self._new("evals", coord.evals)]
        fresh = coord.state.episodes_done - self.cursors.get("episodes", 0)
        self.cursors["episodes"] = coord.state.episodes_done
        if fresh > 0:
            batch.episodes = list(coord.episodes.values())[-fresh:]
        return batch

    def _rewards(self, agent: str, steps: list[dict[str, Any]], groups: list[tuple[float, float]], final: bool
                 ) -> list[tuple[str, int, dict[str, float]]]:
        """The group rewards per training step; a step is written once a newer version exists (or at the end)."""
        pending = self.group_rewards.setdefault(agent, {})
        for _, (at, reward) in self._new(f"rewards/{agent}", groups):
            pending.setdefault(trained_version_at(steps, at), []).append(reward)
        newest = trained_version_at(steps, math.inf)
        ready = sorted(s for s in pending if final or s < newest)
        return [(agent, s, reward_figures(pending.pop(s))) for s in ready]

    def write(self, batch: Batch) -> None:
        with self.lock:
            if not self.closed:
                self._write(batch)

    def _write(self, batch: Batch) -> None:
        self.open()
        for agent, rec in batch.steps:
            self.on_train_step(agent, rec)
        for agent, step, figures in batch.rewards:
            self.on_group_rewards(agent, step, figures)
        for entry in batch.evals:
            self.on_eval(entry)
        for rec in batch.episodes:
            self.on_episode(rec)
        for agent, (step, values) in batch.pipeline.items():
            self.on_pipeline(agent, values, step)
        for agent, version, report in batch.play:
            self.on_play(agent, version, report)
        if self.tb is not None:
            self.tb.flush()

    async def follow(self, coord: Followed, stop: asyncio.Event) -> None:
        """Write what is new every ``logging.interval_s`` until ``stop``; a failing writer is logged, not fatal."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.opts.interval_s)
            if self.closed:
                await stop.wait()
                return
            try:
                await asyncio.to_thread(self.write, self.collect(coord))
            except Exception:
                log.exception("writing the run's TensorBoard / W&B logs failed")

    async def close(self, coord: Followed | None = None) -> None:
        """Write what is left, then flush and close the writers (idempotent)."""
        if self.closed:
            return
        batch = self.collect(coord, final=True) if coord is not None else None
        await asyncio.to_thread(self._finish, batch)

    def _finish(self, batch: Batch | None) -> None:
        with self.lock:
            if self.closed:
                return
            if batch is not None:
                self._write(batch)
            self.closed = True
            self._close_writers()

    def _close_writers(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
