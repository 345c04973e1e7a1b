"""Trainer entry point: ``python -m services.trainer --config C --agent A`` (the service: trainer/service.py).

``tandem up`` starts a new run's trainers once the first turn is played (services/launcher/deferred.py;
docs/architecture.md §9, Start-up).
"""

from __future__ import annotations

import asyncio
import os

from services.common.bus import Bus
from services.common.service import (
    load_or_exit,
    parse_args,
    run_service,
    serve_health_during,
    setup_logging,
    watch_control,
)
from services.common.startup import startup
from services.common.weights_auth import secret_problem
from services.training.backends import make_policy


async def main_async(config: str, agent: str) -> int:
    log = setup_logging(f"trainer.{agent}")
    cfg = load_or_exit(config, agent)
    if (no_secret := secret_problem()) is not None:  # it signs what it publishes (weights_auth.py)
        log.error("%s", no_secret)
        return 2
    acfg = cfg.agents[agent]
    with startup():  # torch, transformers and the model: no collector passes over their objects
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
    bus = Bus(cfg.redis_url, cfg.run.name, f"trainer-{agent}", reconnect_window_s=cfg.run.done_ids_grace_s)
    trainer = TrainerService(cfg, agent, bus, policy)
    try:
        await bus.retrying("resume", trainer.resume)  # a Redis outage at start is waited out, not a death
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
