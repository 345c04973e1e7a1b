"""Rollout entry point: ``python -m services.rollout --config C --agent A [--router URL]``
(the service: rollout/service.py)."""

from __future__ import annotations

import asyncio

from services.common.bus import Bus
from services.common.service import load_or_exit, parse_args, run_service, setup_logging, watch_control
from services.common.weights_auth import secret_problem
from services.rollout.service import RolloutService


async def main_async(config: str, agent: str, router_url: str | None) -> int:
    log = setup_logging(f"rollout.{agent}")
    cfg = load_or_exit(config, agent)
    if (no_secret := secret_problem()) is not None:  # it verifies what its engines load (weights_auth.py)
        log.error("%s", no_secret)
        return 2
    bus = Bus(cfg.redis_url, cfg.run.name, f"rollout-{agent}")
    s = bus.streams
    rollout = await RolloutService.start(cfg, agent, bus, router_url)
    stop = asyncio.Event()
    try:
        await run_service(
            f"rollout.{agent}", bus, stop,
            bus.consume(s.turns(agent), "rollout", bus.service, rollout.on_turn, stop,
                        concurrency=rollout.concurrency, count=64),
            bus.consume(s.weights(agent), "rollout", bus.service, rollout.on_weights, stop),
            watch_control(bus, f"control-rollout-{agent}", stop),
            *rollout.background(stop))
    finally:
        await rollout.close()
    return 0


def main() -> None:
    args = parse_args("rollout", per_agent=True, extra=lambda p: p.add_argument(
        "--router", default=None, help="an externally managed router's URL (then no engines are started here)"))
    raise SystemExit(asyncio.run(main_async(args.config, args.agent, args.router)))


if __name__ == "__main__":
    main()
