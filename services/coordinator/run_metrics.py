"""The run's Prometheus series, served by the coordinator's control API at ``GET /metrics``.

``RunMetrics`` derives them at each scrape from the run state (which folds in every event the coordinator
receives), its episode records, its evaluations and the dead-letter stream: per agent among them the illegal
or format-failure rate of its training episodes, the last step's learning signal (zero-variance groups,
malformed samples) and, per eval opponent, the latest score, its standard error and illegal rate; and the
staleness gates: which agent's gate holds the next group back now, the groups and seconds each gate held
back, and whose gate held back each agent's groups (docs/architecture.md §4). The values read off an event's
``data`` are read in one place, ``event_values``. The per-process series are in services/common/metrics.py.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metrics import exposition
from services.contracts.codec import FIELD, decode
from services.contracts.messages import DeadLetter
from services.contracts.records import GroupState
from services.coordinator.state import AgentState, RunState
from services.coordinator.train_play import RECENT_EPISODES

TRAIN_SECONDS_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RATE_WINDOW_S = 60.0
RECENT_GROUPS = 16


def event_values(kind: str, data: Mapping[str, Any]) -> dict[str, float]:
    """The numbers the series take from one event's data (``train_step`` and ``rollout_load``).

    The run state keeps these events' data (``AgentState.train_steps``, ``AgentState.rollout``)."""
    keys = {"train_step": ("train_seconds", "tokens_per_s", "reward_mean", "stale_frac", "weight_version",
                           "zero_variance_groups", "malformed_rate"),
            "rollout_load": ("queue_depth", "inflight", "capacity", "waiting")}.get(kind, ())
    out = {}
    for k in keys:
        v = data.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


def engine_restarts(rollout: Mapping[str, Any]) -> dict[str, int]:
    """engine URL -> restarts, from a ``rollout_load`` event's data (the fleet's snapshot)."""
    return {str(e.get("url")): int(e.get("restarts") or 0) for e in rollout.get("engines", []) if e.get("url")}


@dataclass
class _Rate:
    """A counter's per-second rate over the last ``RATE_WINDOW_S``, from the values seen at scrapes."""

    points: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=1000))

    def add(self, now: float, total: float) -> float:
        self.points.append((now, total))
        while len(self.points) > 2 and now - self.points[1][0] >= RATE_WINDOW_S:
            self.points.popleft()
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


def staleness(a: AgentState) -> int:
    """How many versions ahead of the loaded weights the newest launched group will train
    (0 .. max_staleness: the launch gate keeps it there)."""
    claimed = a.kept_groups + a.in_flight_groups
    return max(0, (claimed - 1) // max(a.groups_per_batch, 1) - a.loaded_weight_version) if claimed else 0


class RunMetrics(Collector):
    """The coordinator's series in a registry of their own; ``update`` before each exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._state: RunState | None = None
        self._evals: list[dict[str, Any]] = []
        self._tokens: dict[str, int] = {}
        self._counted: set[str] = set()  # episode ids whose tokens are counted
        self._token_rates: dict[str, _Rate] = {}
        self._tokens_per_s: dict[str, float] = {}
        self._dead: dict[str, int] = {}
        self._dead_cursor = "0-0"
        self._starts: dict[str, int] = {}
        self.registry.register(self)

    def update(self, state: RunState, episodes: Mapping[str, Mapping[str, Any]] | None = None,
               evals: list[dict[str, Any]] | None = None, now: float | None = None) -> None:
        """Take the run state, the episode records (for generated tokens) and the evaluations."""
        self._state, self._evals = state, list(evals or [])
        episodes = episodes or {}
        for episode_id, rec in episodes.items():
            if episode_id in self._counted:
                continue
            for turn in rec.get("turns", []):
                if turn.get("agent") in state.agents and isinstance(turn.get("tokens"), int):
                    self._tokens[turn["agent"]] = self._tokens.get(turn["agent"], 0) + turn["tokens"]
        self._counted = set(episodes)  # the records are a bounded cache: forget ids it dropped
        now = time.time() if now is None else now
        for name in state.agents:
            rate = self._token_rates.setdefault(name, _Rate())
            self._tokens_per_s[name] = rate.add(now, self._tokens.get(name, 0))

    async def read_dead_letters(self, redis: Any, stream: str, agents: Iterable[str]) -> None:
        """Count the dead letters added since the last call, per agent (from the stream or service name)."""
        names = list(agents)
        while True:
            entries = await redis.xrange(stream, min=f"({self._dead_cursor}", count=500)
            if not entries:
                return
            for entry_id, fields in entries:
                self._dead_cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    letter = decode(fields[FIELD], DeadLetter)
                except (KeyError, ValueError):
                    letter = None
                agent = _letter_agent(letter, names)
                self._dead[agent] = self._dead.get(agent, 0) + 1

    async def read_starts(self, redis: Any, key: str) -> None:
        """The services' starts, as ``record_start`` counted them."""
        raw = await redis.hgetall(key)
        self._starts = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

    def collect(self) -> Iterator[Metric]:
        state = self._state
        if state is None:
            return
        yield from _run_series(state)
        yield from self._agent_series(state)
        yield from _gate_series(state)
        yield from self._eval_series()
        dead = CounterMetricFamily("tandem_dead_letters", "Dead letters in the run, per agent ('' = none)",
                                   labels=["agent"])
        for agent, n in sorted(self._dead.items()):
            dead.add_metric([agent], n)
        yield dead
        yield self._restarts(state)

    def _restarts(self, state: RunState) -> Metric:
        restarts = CounterMetricFamily("tandem_restarts", "Restarts of a service (starts after its first) or of "
                                       "an engine its rollout supervises", labels=["agent", "service"])
        names = list(state.agents)
        for service, starts in sorted(self._starts.items()):
            agent = next((a for a in names if service.endswith((f"-{a}", f".{a}"))), "")
            restarts.add_metric([agent, service], max(starts - 1, 0))
        for name, a in state.agents.items():
            for url, n in sorted(engine_restarts(a.rollout).items()):
                restarts.add_metric([name, f"engine {url}"], n)
        return restarts

    def _agent_series(self, state: RunState) -> Iterator[Metric]:
        gauges = {k: GaugeMetricFamily(f"tandem_{k}", doc, labels=["agent"]) for k, doc in GAUGES.items()}
        counters = {k: CounterMetricFamily(f"tandem_{k}", doc, labels=["agent"]) for k, doc in COUNTERS.items()}
        groups = CounterMetricFamily("tandem_groups", "Groups the buffer resolved, by outcome",
                                     labels=["agent", "outcome"])
        seconds = HistogramMetricFamily("tandem_train_step_seconds", "Time of one train step",
                                        labels=["agent"])
        for name, a in state.agents.items():
            last = event_values("train_step", a.train_steps[-1]) if a.train_steps else {}
            load = event_values("rollout_load", a.rollout)
            recent = [r for _, r in a.group_rewards[-RECENT_GROUPS:]]
            values = {"weight_version": a.loaded_weight_version, "queue_depth": load.get("queue_depth"),
                      "inflight_turns": load.get("inflight"), "inflight_capacity": load.get("capacity"),
                      "inflight_groups": a.in_flight_groups, "staleness": staleness(a),
                      "max_staleness": a.max_staleness, "gate_blocked": float(a.blocked_by_staleness()),
                      "group_reward": sum(recent) / len(recent) if recent else None,
                      "train_reward": last.get("reward_mean"), "train_stale_fraction": last.get("stale_frac"),
                      "train_tokens_per_second": last.get("tokens_per_s"),
                      **{f"train_{k}": last.get(k) for k in ("zero_variance_groups", "malformed_rate")},
                      "generation_tokens_per_second": self._tokens_per_s.get(name, 0.0)}
            for k, v in values.items():
                if v is not None:
                    gauges[k].add_metric([name], float(v))
            play = _play_totals(a.train_play)
            if play["episodes"]:
                gauges["train_illegal_rate"].add_metric([name], play["recent_invalid"] / play["recent"])
            counters["train_episodes"].add_metric([name], play["episodes"])
            counters["train_illegal_episodes"].add_metric([name], play["invalid_episodes"])
            counters["train_steps"].add_metric([name], len(a.train_steps))
            counters["generated_tokens"].add_metric([name], self._tokens.get(name, 0))
            groups.add_metric([name, GroupState.KEPT.value], a.kept_groups)
            groups.add_metric([name, GroupState.DROPPED.value], a.dropped_groups)
            times = [event_values("train_step", s).get("train_seconds") for s in a.train_steps]
            seconds.add_metric([name], *_buckets([t for t in times if t is not None]))
        yield from gauges.values()
        yield from counters.values()
        yield groups
        yield seconds

    def _eval_series(self) -> Iterator[Metric]:
        score = GaugeMetricFamily("tandem_eval_score", "The latest held-out eval score (0-1) per label "
                                  "(start, end, on-demand)", labels=["agent", "label"])
        latest: dict[tuple[str, str], float] = {}
        for ev in self._evals:
            for agent, s in (ev.get("scores") or {}).items():
                if isinstance(s, int | float):
                    latest[(agent, str(ev.get("label")))] = float(s)
        for (agent, label), s in sorted(latest.items()):
            score.add_metric([agent, label], s)
        yield score
        vs = {k: GaugeMetricFamily(f"tandem_eval_{k}", doc, labels=["agent", "opponent"]) for k, doc in (
            ("opponent_score", "The latest evaluation's score (0-1) against each opponent"),
            ("opponent_score_se", "Its standard error"),
            ("opponent_illegal_rate", "Its fraction of episodes with an illegal or malformed reply"))}
        last: dict[tuple[str, str], dict[str, Any]] = {}
        for ev in self._evals:
            for agent, reports in (ev.get("vs") or {}).items():
                for opponent, r in reports.items():
                    last[(agent, str(opponent))] = r
        for (agent, opponent), r in sorted(last.items()):
            for key, name in (("opponent_score", "score"), ("opponent_score_se", "score_se"),
                              ("opponent_illegal_rate", "illegal_rate")):
                if isinstance(r.get(name), int | float):
                    vs[key].add_metric([agent, opponent], float(r[name]))
        yield from vs.values()

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        return exposition(self.registry, accept)


GAUGES = {
    "weight_version": "Weight version loaded on the agent's engines",
    "queue_depth": "Turn requests waiting for the agent's rollout (stream lag + pending)",
    "inflight_turns": "Turns the agent's rollout is generating now",
    "inflight_capacity": "The rollout's bound on concurrent turns",
    "inflight_groups": "Groups launched and not yet resolved by the buffer",
    "staleness": "Versions the newest launched group is ahead of the loaded weights",
    "max_staleness": "The agent's configured max_staleness",
    "gate_blocked": "1 while the launch gate holds new groups back for this agent",
    "group_reward": f"Mean reward of the agent's last {RECENT_GROUPS} groups",
    "train_reward": "Mean reward of the last trained batch",
    "train_stale_fraction": "Fraction of the last batch older than the trainer's weights",
    "train_tokens_per_second": "Tokens per second of the last train step",
    "train_zero_variance_groups": "Share of the last trained batch's groups with all rewards equal (no signal)",
    "train_malformed_rate": "Share of the last trained batch's samples with an illegal or malformed reply",
    "generation_tokens_per_second": f"Generated tokens per second over the last {RATE_WINDOW_S:.0f} s of scrapes",
    "train_illegal_rate": f"Fraction of the agent's newest training episodes (at least {RECENT_EPISODES}, by weight "
                          "version) with an illegal or malformed reply of its own",
}
COUNTERS = {
    "train_steps": "Train steps the agent's trainer has reported",
    "generated_tokens": "Tokens generated for the agent in the episodes the coordinator recorded",
    "train_episodes": "Training episodes the agent played",
    "train_illegal_episodes": "Training episodes in which the agent's reply was illegal or malformed",
}


def _play_totals(by_version: Mapping[int, Any]) -> dict[str, int]:
    """Episodes and illegal ones in all, and in the newest versions' (at least RECENT_EPISODES) episodes."""
    out = {"episodes": 0, "invalid_episodes": 0, "recent": 0, "recent_invalid": 0}
    for v in sorted(by_version, reverse=True):
        c = by_version[v]
        out["episodes"] += c.episodes
        out["invalid_episodes"] += c.invalid_episodes
        if out["recent"] < RECENT_EPISODES:
            out["recent"] += c.episodes
            out["recent_invalid"] += c.invalid_episodes
    return out


def _run_series(state: RunState) -> Iterator[Metric]:
    yield CounterMetricFamily("tandem_episodes", "Episodes played", value=state.episodes_done)
    yield GaugeMetricFamily("tandem_episodes_per_second", "Episodes per second (30 s window)",
                            value=state.episodes_per_s())
    yield GaugeMetricFamily("tandem_paused", "1 while the run is paused", value=float(state.paused))
    phase = GaugeMetricFamily("tandem_phase", "1 for the run's current phase", labels=["phase"])
    phase.add_metric([state.phase], 1.0)
    yield phase


def _gate_series(state: RunState, now: float | None = None) -> Iterator[Metric]:
    """Which staleness gate holds launches back, how often and how long (docs/architecture.md §4)."""
    now = time.time() if now is None else now
    wait = state.gate_wait
    holding = GaugeMetricFamily("tandem_gate_holding", "1 while this agent's staleness gate holds the next "
                                "group's launch back", labels=["agent"])
    held = CounterMetricFamily("tandem_gate_held_groups", "Groups whose launch this agent's staleness gate held "
                               "back", labels=["agent"])
    held_s = CounterMetricFamily("tandem_gate_held_seconds", "Seconds this agent's staleness gate held launches "
                                 "back (the next group's wait so far included)", labels=["agent"])
    back = CounterMetricFamily("tandem_gate_held_back_groups", "Groups of this agent whose launch a staleness "
                               "gate held back, by the agent whose gate it was", labels=["agent", "gate"])
    for name, a in state.agents.items():
        holding.add_metric([name], float(bool(wait and name in wait.held_by and a.blocked_by_staleness())))
        held.add_metric([name], a.groups_held)
        held_s.add_metric([name], state.held_seconds(a, now))
        for gate, n in sorted(a.held_back_by.items()):
            back.add_metric([name, gate], n)
    yield from (holding, held, held_s, back, GaugeMetricFamily(
        "tandem_gate_wait_seconds", "How long the next group has waited for a closed staleness gate (0: none waits)",
        value=max(now - wait.since, 0.0) if wait else 0.0))


def _buckets(values: list[float]) -> tuple[list[tuple[str, float]], float]:
    cumulative = [(str(b), float(sum(v <= b for v in values))) for b in TRAIN_SECONDS_BUCKETS]
    return [*cumulative, ("+Inf", float(len(values)))], float(sum(values))


def _letter_agent(letter: DeadLetter | None, agents: list[str]) -> str:
    if letter is None:
        return ""
    for agent in agents:
        if letter.source_stream.endswith(f":{agent}") or letter.service.endswith(f"-{agent}"):
            return agent
    return ""
