"""Trainer entry point: ``python -m services.trainer --config C --agent A``.

Loop: take a batch from ``batches:{agent}``, drop samples already trained on
(idempotent by sample id), train one step, write version k+1 as an HF
directory and the full training state (``state/v{k+1}``), commit in Redis what
was trained (sample ids, published version, train log) in one transaction,
publish ``weights:{agent}`` and a ``train_step`` event, and only then
acknowledge the batch.

Resume: the Redis commit is the point of no return. On start the trainer loads
the state of the published version (the latest committed one) and deletes any
newer, uncommitted state; a batch that was trained but not committed before a
crash is redelivered (never acknowledged) and trained again from the committed
state, so no sample is trained on twice. ``TANDEM_TRAINER_FAILPOINT=stage:version``
(stage: after_train, after_state, after_commit) kills the process with SIGKILL at
that point — the resume test's crash injection.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from services.common.bus import Bus
from services.common.service import (
    load_or_exit,
    parse_args,
    run_service,
    serve_health_during,
    setup_logging,
    watch_control,
)
from services.contracts.messages import Batch, Control, Event, Sample, WeightsUpdate
from services.training.backends import make_policy

KEEP_STATES = 2  # committed training states kept on disk (the newest ones)


def failpoint(stage: str, version: int) -> None:
    if os.environ.get("TANDEM_TRAINER_FAILPOINT") == f"{stage}:{version}":
        os.kill(os.getpid(), signal.SIGKILL)


def state_versions(state_root: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in state_root.glob("v*") if p.is_dir() and p.name[1:].isdigit())


def tidy_states(state_root: Path, committed: int) -> None:
    """Remove uncommitted states (newer than ``committed``, or half-written) and all but the newest kept ones."""
    for p in state_root.glob("v*.tmp*"):
        shutil.rmtree(p, ignore_errors=True)
    versions = state_versions(state_root)
    kept = [v for v in versions if v <= committed][-KEEP_STATES:]
    for v in versions:
        if v not in kept:
            shutil.rmtree(state_root / f"v{v:05d}", ignore_errors=True)


async def main_async(config: str, agent: str) -> int:
    log = setup_logging(f"trainer.{agent}")
    cfg = load_or_exit(config, agent)
    acfg = cfg.agents[agent]
    bus = Bus(cfg.redis_url, cfg.run.name, f"trainer-{agent}")
    s = bus.streams
    ckpt_dir = Path(cfg.run.checkpoint_root) / cfg.run.name / agent
    state_root = ckpt_dir / "state"
    version = int(await bus.redis.get(s.published_version(agent)) or 0)
    try:
        policy = await asyncio.to_thread(make_policy, acfg, acfg.sampling.temperature)
    except ValueError as exc:  # a bad algorithm plug-in, LoRA target, megatron layout ...: name the field, stop
        log.error("invalid config %s: agents.%s.%s", config, agent, exc)
        return 2
    if getattr(policy, "follower", False):  # megatron under torchrun: ranks > 0 run what rank 0 runs
        if os.environ.get("LOCAL_RANK", "0") == "0":  # a follower pod (other nodes) still answers its probes
            await serve_health_during(f"trainer.{agent}", lambda: asyncio.to_thread(policy.follow))
        else:
            await asyncio.to_thread(policy.follow)
        return 0
    tidy_states(state_root, version)
    if version:
        start = state_root / f"v{version:05d}"
        if not start.is_dir():
            log.error("version %d is published but its training state %s is missing; cannot resume", version, start)
            return 1
        await asyncio.to_thread(policy.load_state, start)
    else:
        await asyncio.to_thread(policy.save_state, state_root / "v00000", 0)  # what a failed step rolls back to
    log.info("trainer for %s (%s, %s) at version %d", agent, acfg.backend, acfg.algorithm.name, version)
    stop = asyncio.Event()
    busy = asyncio.Lock()  # one policy operation at a time (a step, or a checkpoint command)

    async def announce(rec: dict[str, Any]) -> None:
        """Publish a committed version: its weights, then its train_step event (kept once per version)."""
        await bus.publish(s.weights(agent), WeightsUpdate(agent=agent, version=rec["version"], path=rec["path"],
                                                          checksum=rec["checksum"]))
        if "metrics" in rec:
            await bus.publish(s.events, Event(source=bus.service, kind="train_step", agent=agent, data=rec["metrics"]))

    async def on_batch(batch: Batch) -> None:
        wrong = [x.agent for x in batch.samples if x.agent != agent] + ([batch.agent] if batch.agent != agent else [])
        if wrong:
            raise ValueError(f"batch for agent {batch.agent!r} holds samples of {sorted(set(wrong))}; "
                             f"this trainer trains {agent!r}")
        seen = await bus.redis.smismember(s.trained_samples(agent), [x.id for x in batch.samples])
        fresh = [x for x, done in zip(batch.samples, seen, strict=True) if not done]
        if not fresh:  # a redelivery: re-announce the version it produced (a crash may have lost it)
            for raw in await bus.redis.lrange(s.train_log(agent), 0, -1):
                rec = json.loads(raw)
                if rec["batch_id"] == batch.id:
                    await announce(rec)
            log.info("batch %s already trained; skipping", batch.id)
            return
        async with busy:
            await train(batch, fresh)

    async def train(batch: Batch, fresh: list[Sample]) -> None:
        nonlocal version
        new_version = version + 1
        try:
            metrics = await asyncio.to_thread(policy.train_step, fresh)
            failpoint("after_train", new_version)
            path, checksum = await asyncio.to_thread(policy.save, ckpt_dir / f"v{new_version:05d}")
            await asyncio.to_thread(policy.save_state, state_root / f"v{new_version:05d}", new_version)
            failpoint("after_state", new_version)
            record = {"version": new_version, "batch_id": batch.id, "sample_ids": [x.id for x in fresh],
                      "path": str(path.resolve()), "checksum": checksum,
                      "engines": sorted({e for x in fresh for e in x.engines}),
                      "min_weight_version": min(x.min_weight_version for x in fresh),
                      "metrics": {**metrics, "version": new_version, "batch_step": batch.step}}
            async with bus.redis.pipeline(transaction=True) as pipe:
                pipe.sadd(s.trained_samples(agent), *[x.id for x in fresh])
                pipe.set(s.published_version(agent), new_version)
                pipe.rpush(s.train_log(agent), json.dumps(record))
                await pipe.execute()
        except BaseException:
            log.warning("step %d failed before its commit; rolling back to version %d", new_version, version)
            await asyncio.to_thread(policy.load_state, state_root / f"v{version:05d}")
            raise
        version = new_version
        failpoint("after_commit", version)
        await asyncio.to_thread(tidy_states, state_root, version)
        await announce(record)
        log.info("step %d: reward %.3f loss %.4f clip %.3f (%d samples, %.2fs)", version, metrics["reward_mean"],
                 metrics.get("loss", 0.0), metrics["clip_frac"], len(fresh), metrics["train_seconds"])

    async def on_control(cmd: Control) -> None:
        if cmd.command == "checkpoint":  # every version's state is saved anyway; re-write the current one
            async with busy:
                path = await asyncio.to_thread(policy.save_state, state_root / f"v{version:05d}", version)
            log.info("trainer state (weights, optimizer, scheduler, RNG, version %d) at %s", version, path)

    await run_service(f"trainer.{agent}", bus, stop,
                      bus.consume(s.batches(agent), "trainer", bus.service, Batch, on_batch, stop),
                      watch_control(bus, f"control-trainer-{agent}", stop, on_control))
    if hasattr(policy, "close"):  # releases the megatron follower ranks
        policy.close()
    return 0


def main() -> None:
    args = parse_args("trainer", per_agent=True)
    raise SystemExit(asyncio.run(main_async(args.config, args.agent)))


if __name__ == "__main__":
    main()
