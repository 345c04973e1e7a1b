"""Buffer entry point: ``python -m services.buffer --config C --agent A`` (the service: buffer/service.py)."""

from __future__ import annotations

import asyncio

from services.buffer.service import BufferService
from services.common.bus import Bus
from services.common.service import load_or_exit, parse_args, run_service, setup_logging, watch_control


async def main_async(config: str, agent: str) -> int:
    setup_logging(f"buffer.{agent}")
    cfg = load_or_exit(config, agent)
    bus = Bus(cfg.redis_url, cfg.run.name, f"buffer-{agent}", reconnect_window_s=cfg.run.done_ids_grace_s)
    buffer = BufferService(cfg, agent, bus)
    stop = asyncio.Event()
    await buffer.release()  # a restart may find complete groups waiting
    await run_service(f"buffer.{agent}", bus, stop,
                      bus.consume(bus.streams.samples(agent), "buffer", bus.service, buffer.on_sample, stop),
                      watch_control(bus, f"control-buffer-{agent}", stop), buffer.abandon_overdue(stop))
    return 0


def main() -> None:
    args = parse_args("buffer", per_agent=True)
    raise SystemExit(asyncio.run(main_async(args.config, args.agent)))


if __name__ == "__main__":
    main()
