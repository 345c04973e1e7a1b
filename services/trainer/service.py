"""The trainer service: one handler per stream (``on_batch``, ``on_control``) over a training backend.

``on_batch`` takes a batch from ``batches:{agent}``, drops samples already trained on
(idempotent by sample id), trains one step (then trims the C heap: ``rss_mb`` and ``rss_trimmed_mb`` in its
metrics), writes version k+1 as an HF directory and the
full training state (``state/v{k+1}``), commits in Redis what was trained (sample ids,
published version, train log) in one transaction, publishes ``weights:{agent}`` and a
``train_step`` event, and only then returns (the bus acknowledges the batch).

Resume (``resume``): the Redis commit is the point of no return. On start the trainer loads
the state of the published version (the latest committed one) and deletes any newer,
uncommitted state and every half-written weights directory (``v*.tmp*``, ``tidy_weights``);
a batch that was trained but not committed before a crash is redelivered (never acknowledged)
and trained again from the committed state, so no sample is trained on twice.

A non-finite step (``NonFiniteStep``: loss, gradient or weight) rolls back to the committed state
the same way, but is not retried: ``skip`` records it once in Redis (the batch id, its samples; the
buffer's released count goes back down by one and the batch's groups are marked dropped, in one
script, so the buffer releases a batch in its place and the run does not hang), publishes a
``train_step_skipped`` event and raises ``Reject``, which dead-letters the batch (naming its
samples) and acknowledges it. After ``agents.X.max_nonfinite_steps`` skipped steps in a row the
trainer stops (``failed`` says why; ``main`` exits 1).

``TANDEM_TRAINER_FAILPOINT=stage:version`` (stage: after_train, after_state, after_commit) kills
the process with SIGKILL at that point — the resume test's crash injection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
from pathlib import Path

from services.common.bus import Bus, Reject
from services.common.history import TrainLogSpill, train_log_archive
from services.common.metrics import SKIPPED_STEPS
from services.common.weight_retention import prune_weight_versions
from services.common.weights_auth import run_secret, sign
from services.contracts.config import TandemConfig
from services.contracts.messages import Batch, Control, Sample, TrainStep, TrainStepSkipped, WeightsUpdate
from services.contracts.records import GroupState, SkipRecord, TrainLogRecord, Verdict
from services.training.backends import Policy
from services.training.memory import release_heap
from services.training.signal import learning_signal
from services.training.step import NonFiniteStep

KEEP_STATES = 2  # committed training states kept on disk (the newest ones)

# Record a skipped batch once: count the buffer's released batches back down, mark its groups dropped.
# KEYS: skipped-batches hash, released counter, buffer verdicts, skips-in-a-row counter (its entry in
# contracts/keys.py SCRIPTS); ARGV: batch id, record (``SkipRecord``), verdict (``Verdict``), skips in a row,
# group ids...
SKIP = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
redis.call('SET', KEYS[4], ARGV[4])
for i = 5, #ARGV do redis.call('HSET', KEYS[3], ARGV[i], ARGV[3]) end
return 1
"""


def failpoint(stage: str, version: int) -> None:
    if os.environ.get("TANDEM_TRAINER_FAILPOINT") == f"{stage}:{version}":
        os.kill(os.getpid(), signal.SIGKILL)


def state_versions(state_root: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in state_root.glob("v*") if p.is_dir() and p.name[1:].isdigit())


def tidy_weights(ckpt_dir: Path) -> list[Path]:
    """Remove the half-written weights directories (``v*.tmp*``) a trainer killed mid-save left; return them.
    Called at start only: no other trainer of the agent writes there (one run, one stack)."""
    leftovers = sorted(p for p in ckpt_dir.glob("v*.tmp*") if p.is_dir())
    for p in leftovers:
        shutil.rmtree(p, ignore_errors=True)
    return leftovers


def tidy_states(state_root: Path, committed: int) -> None:
    """Remove uncommitted states (newer than ``committed``, or half-written) and all but the newest kept ones."""
    for p in state_root.glob("v*.tmp*"):
        shutil.rmtree(p, ignore_errors=True)
    versions = state_versions(state_root)
    kept = [v for v in versions if v <= committed][-KEEP_STATES:]
    for v in versions:
        if v not in kept:
            shutil.rmtree(state_root / f"v{v:05d}", ignore_errors=True)


class TrainerService:
    """One agent's trainer. Build it, ``await resume()``, then wire ``on_batch`` and ``on_control``."""

    def __init__(self, cfg: TandemConfig, agent: str, bus: Bus, policy: Policy) -> None:
        self.cfg, self.agent, self.bus, self.policy = cfg, agent, bus, policy
        self.log = logging.getLogger(f"tandem.trainer.{agent}")
        self.ckpt_dir = Path(cfg.run.checkpoint_root) / cfg.run.name / agent
        self.state_root = self.ckpt_dir / "state"
        self.weight_version = 0
        self.busy = asyncio.Lock()  # one policy operation at a time (a step, or a checkpoint command)
        self.max_nonfinite = cfg.agents[agent].max_nonfinite_steps
        self.nonfinite_in_row = 0
        self.failed: str | None = None  # why the trainer stopped itself
        self.stop = asyncio.Event()  # set by a stop command, or when the trainer stops itself
        self._skip = bus.redis.register_script(SKIP)
        self.secret = b""  # the run's weights-signing secret (``resume`` reads it)
        # bounded state (docs/architecture.md §10): the log's older records, with their trained-sample ids, leave
        # Redis for <checkpoint_root>/<run>/<agent>/train_log.jsonl (common/history.py says why that is safe)
        kept = max(cfg.run.state_kept_steps, cfg.agents[agent].max_staleness + TrainLogSpill.MIN_KEPT)
        self.history = TrainLogSpill(bus.redis, bus.streams, agent,
                                     train_log_archive(cfg.run.checkpoint_root, cfg.run.name, agent), kept)

    def state_dir(self, version: int) -> Path:
        return self.state_root / f"v{version:05d}"

    async def resume(self) -> None:
        """Start from the published version's training state (or save version 0's, what a failed step rolls
        back to). Raises RuntimeError when the published version's state is missing."""
        s = self.bus.streams
        self.secret = run_secret()
        self.nonfinite_in_row = int(await self.bus.redis.get(s.nonfinite_in_row(self.agent)) or 0)
        if self.nonfinite_in_row >= self.max_nonfinite:
            raise RuntimeError(f"the trainer stopped after {self.nonfinite_in_row} non-finite training steps in a row "
                               f"(agents.{self.agent}.max_nonfinite_steps = {self.max_nonfinite}); "
                               f"see train_step_skipped events and the dead-letter stream")
        self.weight_version = int(await self.bus.redis.get(s.published_weight_version(self.agent)) or 0)
        await asyncio.to_thread(tidy_states, self.state_root, self.weight_version)
        if leftovers := await asyncio.to_thread(tidy_weights, self.ckpt_dir):
            self.log.info("removed %d half-written weights directories: %s", len(leftovers),
                          ", ".join(p.name for p in leftovers))
        if self.weight_version:
            start = self.state_dir(self.weight_version)
            if not start.is_dir():
                raise RuntimeError(f"version {self.weight_version} is published but its training state {start} is "
                                   "missing; cannot resume")
            await asyncio.to_thread(self.policy.load_state, start)
        else:
            await asyncio.to_thread(self.policy.save_state, self.state_dir(0), 0)

    # --- handlers ---------------------------------------------------------------------
    async def on_batch(self, batch: Batch) -> None:
        agent, s = self.agent, self.bus.streams
        wrong = [x.agent for x in batch.samples if x.agent != agent] + ([batch.agent] if batch.agent != agent else [])
        if wrong:
            raise Reject(f"batch for agent {batch.agent!r} holds samples of {sorted(set(wrong))}; "
                             f"this trainer trains {agent!r}")
        skipped = await self.bus.redis.hget(s.skipped_batches(agent), batch.id)
        if skipped is not None:  # a redelivery of a skipped batch: re-announce the skip, dead-letter it
            await self.reject_skipped(SkipRecord.parse(skipped))
        seen = await self.bus.redis.smismember(s.trained_samples(agent), [x.id for x in batch.samples])
        fresh = [x for x, done in zip(batch.samples, seen, strict=True) if not done]
        if not fresh:  # a redelivery: re-announce the version it produced (a crash may have lost it)
            for raw in await self.bus.redis.lrange(s.train_log(agent), 0, -1):
                rec = TrainLogRecord.parse(raw)
                if rec.batch_id == batch.id:
                    await self.announce(rec)
            self.log.info("batch %s already trained; skipping", batch.id)
            return
        async with self.busy:
            await self.train(batch, fresh)

    async def on_control(self, cmd: Control) -> None:
        if cmd.command == "checkpoint":  # every version's state is saved anyway; re-write the current one
            async with self.busy:
                v = self.weight_version
                path = await asyncio.to_thread(self.policy.save_state, self.state_dir(v), v)
            self.log.info("trainer state (weights, optimizer, scheduler, RNG, version %d) at %s", v, path)

    # --- one step ---------------------------------------------------------------------
    async def train(self, batch: Batch, fresh: list[Sample]) -> None:
        new_version = self.weight_version + 1
        try:
            metrics = {**await asyncio.to_thread(self.policy.train_step, fresh), **learning_signal(fresh)}
            metrics.update(await asyncio.to_thread(release_heap))  # the step's freed peak back to the system
            failpoint("after_train", new_version)
            path, checksum = await asyncio.to_thread(self.policy.save, self.ckpt_dir / f"v{new_version:05d}")
            await asyncio.to_thread(self.policy.save_state, self.state_dir(new_version), new_version)
            failpoint("after_state", new_version)
            record = TrainLogRecord(
                weight_version=new_version, batch_id=batch.id, sample_ids=[x.id for x in fresh],
                path=str(path.resolve()), checksum=checksum,
                signature=sign(self.secret, self.agent, new_version, str(path.resolve()), checksum),
                engines=sorted({e for x in fresh for e in x.engines}),
                min_weight_version=min(x.min_weight_version for x in fresh), metrics=metrics,
                batch_weight_version=batch.weight_version)
            await self.commit(fresh, record)
        except NonFiniteStep as exc:
            self.log.warning("step %d is non-finite (%s); rolling back to version %d", new_version, exc,
                             self.weight_version)
            await asyncio.to_thread(self.policy.load_state, self.state_dir(self.weight_version))
            await self.skip(batch, fresh, str(exc))
        except BaseException:
            self.log.warning("step %d failed before its commit; rolling back to version %d", new_version,
                             self.weight_version)
            await asyncio.to_thread(self.policy.load_state, self.state_dir(self.weight_version))
            raise
        self.weight_version = new_version
        self.nonfinite_in_row = 0
        failpoint("after_commit", new_version)
        await asyncio.to_thread(tidy_states, self.state_root, new_version)
        await asyncio.to_thread(prune_weight_versions, self.ckpt_dir, new_version, self.cfg.run.checkpoint_retention,
                                self.cfg.environment.eval.every_n_steps)
        await self.announce(record)
        await self.spill()
        self.log.info("step %d: reward %.3f loss %.4f clip %.3f zero-variance groups %.2f malformed %.2f (%d samples, "
                      "%.2fs)", new_version, metrics["reward_mean"], metrics.get("loss", 0.0), metrics["clip_frac"],
                      metrics.get("zero_variance_groups", 0.0), metrics.get("malformed_rate", 0.0), len(fresh),
                      metrics["train_seconds"])

    async def skip(self, batch: Batch, fresh: list[Sample], reason: str) -> None:
        """Record a non-finite step once, report it, stop at the limit; raise ``Reject`` (dead-letter + ack)."""
        s = self.bus.streams
        self.nonfinite_in_row += 1
        SKIPPED_STEPS.labels(agent=self.agent).inc()
        groups = sorted({x.group_id for x in fresh})
        rec = SkipRecord(batch_id=batch.id, batch_weight_version=batch.weight_version, reason=reason,
                         sample_ids=[x.id for x in fresh], group_ids=groups, consecutive=self.nonfinite_in_row,
                         weight_version=self.weight_version)
        keys = [s.skipped_batches(self.agent), s.batches_released(self.agent), s.buffer_verdicts(self.agent),
                s.nonfinite_in_row(self.agent)]
        verdict = Verdict(state=GroupState.DROPPED, reason="non-finite training step").encode()
        await self._skip(keys=keys, args=[batch.id, rec.dump(), verdict, self.nonfinite_in_row, *groups])
        if self.nonfinite_in_row >= self.max_nonfinite:
            self.failed = (f"{self.nonfinite_in_row} training steps in a row were non-finite "
                           f"(agents.{self.agent}.max_nonfinite_steps = {self.max_nonfinite}); last: {reason}")
            self.log.error("stopping: %s", self.failed)
            self.stop.set()
        await self.reject_skipped(rec)

    async def reject_skipped(self, rec: SkipRecord) -> None:
        await self.bus.publish(self.bus.streams.events, TrainStepSkipped(
            source=self.bus.service, agent=self.agent, batch_id=rec.batch_id,
            batch_weight_version=rec.batch_weight_version, reason=rec.reason, sample_ids=rec.sample_ids,
            group_ids=rec.group_ids, consecutive=rec.consecutive))
        raise Reject(f"training step skipped, nothing published ({rec.reason}); the weights stay at version "
                     f"{rec.weight_version}; rejected samples: {', '.join(rec.sample_ids)}")

    async def commit(self, fresh: list[Sample], record: TrainLogRecord) -> None:
        """The point of no return: what was trained, the published version and the log, in one transaction."""
        s = self.bus.streams
        async with self.bus.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(s.trained_samples(self.agent), *[x.id for x in fresh])
            pipe.set(s.published_weight_version(self.agent), record.weight_version)
            pipe.rpush(s.train_log(self.agent), record.dump())
            pipe.set(s.nonfinite_in_row(self.agent), 0)
            await pipe.execute()

    async def spill(self) -> None:
        """Archive the train log's older records (after the commit and its announcement: never before)."""
        try:
            moved = await self.history.spill()
        except OSError as exc:  # a full or unwritable disk: Redis keeps the records until a later spill works
            self.log.warning("cannot archive the train log to %s: %r", self.history.archive, exc)
            return
        if moved:
            self.log.info("archived %d train-log records to %s", moved, self.history.archive)

    async def announce(self, rec: TrainLogRecord) -> None:
        """Publish a committed version: its weights, then its train_step event (kept once per version)."""
        s = self.bus.streams
        await self.bus.publish(s.weights(self.agent), WeightsUpdate(
            agent=self.agent, weight_version=rec.weight_version, path=rec.path, checksum=rec.checksum,
            signature=rec.signature or sign(self.secret, self.agent, rec.weight_version, rec.path, rec.checksum)))
        if rec.metrics is not None:
            await self.bus.publish(s.events, TrainStep(source=self.bus.service, agent=self.agent,
                                                       weight_version=rec.weight_version,
                                                       batch_weight_version=rec.batch_weight_version,
                                                       metrics=rec.metrics))
