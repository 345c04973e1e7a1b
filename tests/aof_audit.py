"""Audit of a finished run from its Redis state (a live Redis, or the embedded one reopened on a copy of its
AOF): where every sample the buffer acknowledged ended up (issue 11; docs/architecture.md §2.3, §5).

``read_agent`` is the one function that touches Redis: it copies what the audit needs into an ``AgentState``
(plain data). Everything else is a pure function of that state, reusable by any test:

* ``acknowledged`` — the ids of the ``samples:{agent}`` entries the buffer's consumer group acknowledged
  (delivered, and no longer pending). The stream must be untrimmed (``run.trim_interval_s: 0``);
* ``account`` — each acknowledged sample in exactly one place: ``trained`` (in exactly one record of the
  trainer's log), ``dropped`` / ``abandoned`` (its group's verdict, or the coordinator's ledger entry, with a
  non-empty reason), or ``unused`` (kept, or still incomplete, when the run's last step was trained: the
  buffer keeps such samples stored, never trained); anything else is a problem;
* ``problems`` — every broken promise, as sentences: a sample trained twice, a trained sample the buffer
  never acknowledged or whose group is not ``kept``, an acknowledged sample in no state, a dropped or
  abandoned group without its reason, weight versions not ``1..total_steps``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.history import read_jsonl, train_log_archive
from services.contracts.codec import FIELD, decode
from services.contracts.messages import Sample
from services.contracts.records import Verdict
from services.contracts.streams import Streams

CONSUMER_GROUP = "buffer"


@dataclass
class AgentState:
    """What the audit reads of one agent, as plain data."""

    agent: str
    entries: list[tuple[str, Sample]]  # samples:{agent}, in stream order (entry id, sample)
    last_delivered: str  # the buffer consumer group's last-delivered-id ("0-0": none)
    pending: set[str]  # entry ids delivered but not acknowledged
    verdicts: dict[str, str]  # group id -> the buffer's verdict ("kept", "dropped:<why>", "abandoned:<why>")
    ledger: dict[str, dict[str, Any]]  # group id -> the coordinator's ledger entry
    train_log: list[dict[str, Any]]  # the trainer's log, one record per committed version
    ready: list[str] = field(default_factory=list)  # kept groups still queued for a batch
    undecided: list[str] = field(default_factory=list)  # emitted groups without a verdict
    archived: dict[str, dict[str, Any]] = field(default_factory=dict)  # group id -> outcome the ledger archived


@dataclass
class Accounting:
    """Where the acknowledged samples of one agent ended up (sample ids per place)."""

    trained: set[str] = field(default_factory=set)
    dropped: dict[str, str] = field(default_factory=dict)  # sample id -> reason
    abandoned: dict[str, str] = field(default_factory=dict)  # sample id -> reason
    unused: set[str] = field(default_factory=set)
    unaccounted: set[str] = field(default_factory=set)

    def counts(self) -> dict[str, int]:
        return {"trained": len(self.trained), "dropped": len(self.dropped), "abandoned": len(self.abandoned),
                "unused": len(self.unused), "unaccounted": len(self.unaccounted)}


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def read_agent(client: Any, run: str, agent: str, checkpoint_root: Path | None = None,
               run_dir: Path | None = None) -> AgentState:
    """Copy one agent's audit data out of a (synchronous) redis client, with what the run archived out of Redis
    (the trainer's older log records under ``checkpoint_root``, the ledger's final groups under ``run_dir``)."""
    s = Streams(run)
    log = {}
    if checkpoint_root is not None:
        log = {int(rec["version"]): rec for rec in read_jsonl(train_log_archive(checkpoint_root, run, agent))}
    log.update({int(rec["version"]): rec for rec in (json.loads(x) for x in client.lrange(s.train_log(agent), 0, -1))})
    archived = {rec["group_id"]: rec for rec in read_jsonl(run_dir / f"ledger.{agent}.jsonl")} if run_dir else {}
    stream = s.samples(agent)
    entries = [(_s(eid), decode(f[FIELD], Sample)) for eid, f in client.xrange(stream)]
    group = next((g for g in client.xinfo_groups(stream) if _s(g["name"]) == CONSUMER_GROUP), None) \
        if client.exists(stream) else None
    pending: set[str] = set()
    if group is not None and int(group["pending"]):
        pending = {_s(p["message_id"]) for p in client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 1_000_000)}
    return AgentState(
        agent=agent, entries=entries, last_delivered=_s(group["last-delivered-id"]) if group else "0-0",
        pending=pending,
        verdicts={_s(k): _s(v) for k, v in client.hgetall(s.buffer_verdicts(agent)).items()},
        ledger={_s(k): json.loads(v) for k, v in client.hgetall(s.group_ledger(agent)).items()},
        train_log=[log[v] for v in sorted(log)], archived=archived,
        ready=[_s(g) for g in client.lrange(s.buffer_ready(agent), 0, -1)],
        undecided=[_s(g) for g in client.zrange(s.groups_pending(agent), 0, -1)])


def entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def acknowledged(state: AgentState) -> dict[str, Sample]:
    """Sample id -> sample, for every stream entry the buffer acknowledged (delivered and not pending)."""
    last = entry_key(state.last_delivered)
    return {sample.id: sample for eid, sample in state.entries
            if entry_key(eid) <= last and eid not in state.pending}


def trained_counts(state: AgentState) -> Counter[str]:
    """How many log records each sample id is in (a trained sample: exactly one)."""
    return Counter(sid for rec in state.train_log for sid in rec["sample_ids"])


def group_fate(state: AgentState, group_id: str) -> tuple[str, str]:
    """(outcome, reason) of a group: the buffer's verdict, else the coordinator's ledger, else ("", "")."""
    if group_id in state.verdicts:
        verdict = Verdict.parse(state.verdicts[group_id])
        return verdict.state, verdict.reason
    entry = state.ledger.get(group_id) or {}
    if entry.get("state") == "abandoned":
        return "abandoned", str(entry.get("reason") or "")
    if group_id in state.archived:  # pruned from Redis (coordinator/ledger.py prune): its final outcome
        return str(state.archived[group_id]["state"]), str(state.archived[group_id].get("reason") or "")
    return "", ""


def account(state: AgentState) -> Accounting:
    """Put each acknowledged sample in its one place (see the module docstring)."""
    out = Accounting()
    trained = trained_counts(state)
    unused_groups = set(state.ready) | set(state.undecided)
    for sid, sample in acknowledged(state).items():
        outcome, reason = group_fate(state, sample.group_id)
        if trained[sid]:
            out.trained.add(sid)
        elif outcome == "dropped":
            out.dropped[sid] = reason
        elif outcome == "abandoned":
            out.abandoned[sid] = reason
        elif sample.group_id in unused_groups:
            out.unused.add(sid)
        else:
            out.unaccounted.add(sid)
    return out


def version_problems(state: AgentState, total_steps: int) -> list[str]:
    versions = [int(rec["version"]) for rec in state.train_log]
    if versions != list(range(1, total_steps + 1)):
        return [f"{state.agent}: weight versions {versions}, not 1..{total_steps} in order"]
    return []


def problems(state: AgentState, total_steps: int) -> list[str]:
    """Every broken promise of one agent's run, one sentence each (empty: the audit passes)."""
    out = version_problems(state, total_steps)
    acked = acknowledged(state)
    trained = trained_counts(state)
    twice = sorted(sid for sid, n in trained.items() if n > 1)
    if twice:
        out.append(f"{state.agent}: {len(twice)} sample(s) trained more than once: {twice[:5]}")
    never_acked = sorted(set(trained) - set(acked))
    if never_acked:
        out.append(f"{state.agent}: {len(never_acked)} trained sample(s) the buffer never acknowledged: "
                   f"{never_acked[:5]}")
    not_kept = sorted({acked[sid].group_id for sid in trained if sid in acked
                       and group_fate(state, acked[sid].group_id)[0] != "kept"})
    if not_kept:
        out.append(f"{state.agent}: trained group(s) whose verdict is not 'kept': {not_kept[:5]}")
    acc = account(state)
    if acc.unaccounted:
        out.append(f"{state.agent}: {len(acc.unaccounted)} acknowledged sample(s) in no trained batch and no "
                   f"dropped, abandoned or unused group: {sorted(acc.unaccounted)[:5]}")
    no_reason = sorted(sid for sid, why in {**acc.dropped, **acc.abandoned}.items() if not why)
    if no_reason:
        out.append(f"{state.agent}: {len(no_reason)} dropped/abandoned sample(s) without a reason: {no_reason[:5]}")
    return out


def reasons(state: AgentState) -> Counter[str]:
    """How many acknowledged samples were dropped or abandoned, per reason (the reason's first words)."""
    acc = account(state)
    return Counter(f"{kind}: {why.split(':')[0]}" for kind, part in (("dropped", acc.dropped),
                                                                     ("abandoned", acc.abandoned))
                   for why in part.values())


def ledger_reasons(state: AgentState) -> Counter[str]:
    """Groups the coordinator abandoned before emitting any sample (no sample of them reached the buffer), per
    reason (its first words): the work a fault cost without a sample to account for. The ledger's entries still in
    Redis and those it archived (pruned past the staleness horizon) alike."""
    return Counter(str(e.get("reason") or "").split(":")[0] for g, e in {**state.archived, **state.ledger}.items()
                   if e.get("state") == "abandoned" and g not in state.verdicts)
