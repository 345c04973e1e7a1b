"""Coordinator entry point: ``python -m services.coordinator --config C [--port P]``.

Loads the config, builds the ``Coordinator`` (scheduler.py), restores the run from Redis,
and wires each stream to its handler; the control API and the run itself run beside them.
"""

from __future__ import annotations

import asyncio

import uvicorn

from services.common.bus import Bus
from services.common.service import load_or_exit, parse_args, run_service, setup_logging, watch_control
from services.coordinator.api import create_app
from services.coordinator.scheduler import Coordinator
from services.coordinator.tracking import RunLogger

RUN_FAILED = 3  # the launcher's supervisor does not restart this exit code (services/launcher/processes.py)


async def main_async(config: str, port: int | None) -> int:
    log = setup_logging("coordinator")
    cfg = load_or_exit(config)
    bus = Bus(cfg.redis_url, cfg.run.name, "coordinator", reconnect_window_s=cfg.run.done_ids_grace_s)
    try:
        coord = Coordinator(cfg, bus)
    except ValueError as exc:  # the environment does not fit the config: name the field, do not start
        log.error("invalid config %s: %s", config, exc)
        await bus.close()
        return 2
    await bus.retrying("restore", coord.restore)  # a Redis outage at start is waited out, not a death
    stop, s = asyncio.Event(), bus.streams
    server = uvicorn.Server(uvicorn.Config(create_app(coord), host=cfg.api.host, port=port or cfg.api.port,
                                           log_level="warning", lifespan="off"))
    run_logger = RunLogger(cfg)  # TensorBoard / W&B (services/coordinator/tracking.py)
    await asyncio.to_thread(run_logger.open)  # their heavy imports and W&B's start, before any loop reads

    runner = asyncio.ensure_future(coord.run_and_report(server, run_logger))
    await run_service("coordinator", bus, stop,
                      bus.consume(s.replies(coord.name), "coordinator", coord.name, coord.router.on_reply,
                                  stop, concurrency=1, count=64),
                      bus.consume(s.events, "coordinator", coord.name, coord.events.on_event, stop),
                      watch_control(bus, "control-coordinator", stop, coord.on_control, stop_on_stop=False),
                      server.serve(), coord.housekeeping(stop), run_logger.follow(coord, stop), runner)
    if coord.state.error is not None:  # the run failed for good (recorded in Redis): a restart cannot fix it
        return RUN_FAILED
    ok = runner.done() and not runner.cancelled() and runner.exception() is None
    return 0 if ok else 1


def main() -> None:
    args = parse_args("coordinator", per_agent=False,
                      extra=lambda p: p.add_argument("--port", type=int, default=None))
    raise SystemExit(asyncio.run(main_async(args.config, args.port)))


if __name__ == "__main__":
    main()
