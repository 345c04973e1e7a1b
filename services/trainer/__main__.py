"""Trainer entry point: ``python -m services.trainer --config C --agent A`` (the service: trainer/service.py).

Under ``tandem up`` (``TRAINER_AFTER_FIRST_TURN_ENV`` set) the trainer imports torch and loads its model only once its
agent's first turn is on the turns stream (or after ``FIRST_TURN_WAIT_S``): on a small machine its start would
otherwise compete for the CPU with the engines the first turn waits for, while the trainer is needed only once
a batch is played (docs/architecture.md §9, Start-up).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import redis.asyncio as aioredis

from services.common.bus import Bus
from services.common.service import (
    load_or_exit,
    parse_args,
    run_service,
    serve_health_during,
    setup_logging,
    watch_control,
)
from services.common.weights_auth import secret_problem
from services.contracts.config import TRAINER_AFTER_FIRST_TURN_ENV, TandemConfig
from services.contracts.streams import Streams
from services.training.backends import make_policy

FIRST_TURN_WAIT_S = 60.0
BLOCK_MS = 1000


async def after_first_turn(cfg: TandemConfig, agent: str, log: logging.Logger) -> None:
    """Wait (at most ``FIRST_TURN_WAIT_S``) until the agent's turns stream has an entry, when asked to."""
    if os.environ.get(TRAINER_AFTER_FIRST_TURN_ENV) != "1":
        return
    stream, deadline = Streams(cfg.run.name).turns(agent), time.monotonic() + FIRST_TURN_WAIT_S
    client = aioredis.from_url(cfg.redis_url)
    try:
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            try:  # from id 0: an entry already there answers at once, else Redis wakes us on the first one;
                # blocks of at most a second stay inside the client's read timeout
                if await client.xread({stream: "0"}, count=1, block=min(left_ms, BLOCK_MS)):
                    return
            except aioredis.TimeoutError:
                continue
            except (aioredis.ConnectionError, OSError, TimeoutError):
                await asyncio.sleep(0.2)  # Redis starting or restarting: the wait goes on
        log.info("no turn for %s after %.0fs; starting anyway", agent, FIRST_TURN_WAIT_S)
    finally:
        await client.aclose()


async def main_async(config: str, agent: str) -> int:
    log = setup_logging(f"trainer.{agent}")
    cfg = load_or_exit(config, agent)
    if (no_secret := secret_problem()) is not None:  # it signs what it publishes (weights_auth.py)
        log.error("%s", no_secret)
        return 2
    acfg = cfg.agents[agent]
    await after_first_turn(cfg, agent, log)
    from services.trainer.service import TrainerService  # torch: only now

    try:
        policy = await asyncio.to_thread(make_policy, acfg, acfg.sampling.temperature)
    except ValueError as exc:  # a bad algorithm plug-in, LoRA target, megatron layout ...: name the field, stop
        log.error("invalid config %s: agents.%s.%s", config, agent, exc)
        return 2
    if policy.follower:  # megatron under torchrun: ranks > 0 run what rank 0 runs
        if os.environ.get("LOCAL_RANK", "0") == "0":  # a follower pod (other nodes) still answers its probes
            await serve_health_during(f"trainer.{agent}", lambda: asyncio.to_thread(policy.follow))
        else:
            await asyncio.to_thread(policy.follow)
        return 0
    bus = Bus(cfg.redis_url, cfg.run.name, f"trainer-{agent}")
    trainer = TrainerService(cfg, agent, bus, policy)
    try:
        await trainer.resume()
    except RuntimeError as exc:
        log.error("%s", exc)
        await bus.close()
        return 1
    log.info("trainer for %s (%s, %s) at version %d", agent, acfg.backend, acfg.algorithm.name, trainer.weight_version)
    stop = trainer.stop
    await run_service(f"trainer.{agent}", bus, stop,
                      bus.consume(bus.streams.batches(agent), "trainer", bus.service, trainer.on_batch, stop),
                      watch_control(bus, f"control-trainer-{agent}", stop, trainer.on_control))
    policy.close()  # releases the megatron follower ranks
    if trainer.failed:
        log.error("trainer for %s stopped: %s", agent, trainer.failed)
        return 1
    return 0


def main() -> None:
    args = parse_args("trainer", per_agent=True)
    raise SystemExit(asyncio.run(main_async(args.config, args.agent)))


if __name__ == "__main__":
    main()
