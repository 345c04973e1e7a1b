"""Trainer entry point: ``python -m services.trainer --config C --agent A``.

Loop: take a batch from ``batches:{agent}``, drop samples already trained on
(idempotent by sample id), train one step, write version k+1 as an HF
directory, record what was trained, publish ``weights:{agent}`` and a
``train_step`` event, and only then acknowledge the batch.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from services.common.bus import Bus
from services.common.service import load_or_exit, parse_args, run_service, setup_logging, watch_control
from services.contracts.messages import Batch, Control, Event, WeightsUpdate
from services.trainer.torch_backend import TorchPolicy


async def main_async(config: str, agent: str) -> int:
    log = setup_logging(f"trainer.{agent}")
    cfg = load_or_exit(config, agent)
    acfg = cfg.agents[agent]
    bus = Bus(cfg.redis_url, cfg.run.name, f"trainer-{agent}")
    s = bus.streams
    ckpt_dir = Path(cfg.run.checkpoint_root) / cfg.run.name / agent
    version = int(await bus.redis.get(s.published_version(agent)) or 0)
    start_path = ckpt_dir / f"v{version:05d}" if version else Path(acfg.model_path)
    policy = await asyncio.to_thread(TorchPolicy, str(start_path), acfg.algorithm, acfg.sampling.temperature,
                                     acfg.seed)
    log.info("trainer for %s at version %d from %s", agent, version, start_path)
    stop = asyncio.Event()

    async def on_batch(batch: Batch) -> None:
        nonlocal version
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
                    await bus.publish(s.weights(agent), WeightsUpdate(agent=agent, version=rec["version"],
                                                                      path=rec["path"], checksum=rec["checksum"]))
            log.info("batch %s already trained; skipping", batch.id)
            return
        metrics = await asyncio.to_thread(policy.train_step, fresh)
        new_version = version + 1
        path, checksum = await asyncio.to_thread(policy.save, ckpt_dir / f"v{new_version:05d}")
        record = {"version": new_version, "batch_id": batch.id, "sample_ids": [x.id for x in fresh],
                  "path": str(path.resolve()), "checksum": checksum,
                  "engines": sorted({e for x in fresh for e in x.engines}),
                  "min_weight_version": min(x.min_weight_version for x in fresh)}
        async with bus.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(s.trained_samples(agent), *[x.id for x in fresh])
            pipe.set(s.published_version(agent), new_version)
            pipe.rpush(s.train_log(agent), json.dumps(record))
            await pipe.execute()
        version = new_version
        await bus.publish(s.weights(agent), WeightsUpdate(agent=agent, version=version, path=str(path.resolve()),
                                                          checksum=checksum))
        await bus.publish(s.events, Event(source=bus.service, kind="train_step", agent=agent,
                                          data={**metrics, "version": version, "batch_step": batch.step}))
        log.info("step %d: reward %.3f loss %.4f clip %.3f (%d samples, %.2fs)", version, metrics["reward_mean"],
                 metrics["pg_loss"], metrics["clip_frac"], len(fresh), metrics["train_seconds"])

    async def on_control(cmd: Control) -> None:
        if cmd.command == "checkpoint":
            path = await asyncio.to_thread(policy.save_state, ckpt_dir / "trainer_state.pt", version)
            log.info("trainer state (optimizer, RNG, version %d) saved to %s", version, path)

    await run_service(f"trainer.{agent}", bus, stop,
                      bus.consume(s.batches(agent), "trainer", bus.service, Batch, on_batch, stop),
                      watch_control(bus, f"control-trainer-{agent}", stop, on_control))
    return 0


def main() -> None:
    args = parse_args("trainer", per_agent=True)
    raise SystemExit(asyncio.run(main_async(args.config, args.agent)))


if __name__ == "__main__":
    main()
