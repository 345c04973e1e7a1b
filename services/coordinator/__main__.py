"""Coordinator entry point: ``python -m services.coordinator --config C [--port P]``."""

from __future__ import annotations

import asyncio
import time

import uvicorn

from services.common.bus import Bus
from services.common.service import load_or_exit, parse_args, run_service, setup_logging, watch_control
from services.contracts.messages import Control, Event, GenerateReply
from services.coordinator.api import create_app
from services.coordinator.report import write_report
from services.coordinator.scheduler import Coordinator
from services.coordinator.tracking import RunLogger


async def main_async(config: str, port: int | None) -> int:
    log = setup_logging("coordinator")
    cfg = load_or_exit(config)
    bus = Bus(cfg.redis_url, cfg.run.name, "coordinator")
    try:
        coord = Coordinator(cfg, bus)
    except ValueError as exc:  # the environment does not fit the config: name the field, do not start
        log.error("invalid config %s: %s", config, exc)
        await bus.close()
        return 2
    stop = asyncio.Event()
    s = bus.streams
    server = uvicorn.Server(uvicorn.Config(create_app(coord), host=cfg.api.host, port=port or cfg.api.port,
                                           log_level="warning", lifespan="off"))
    started = time.time()
    run_logger = RunLogger(cfg)  # TensorBoard / W&B (services/coordinator/tracking.py)
    await asyncio.to_thread(run_logger.open)  # their heavy imports and W&B's start, before any loop reads

    async def on_control(cmd: Control) -> None:  # commands published on the control stream
        if cmd.command in ("pause", "resume", "stop"):  # its own final stop comes after the run: a no-op
            await coord.control(cmd.command, publish=False)

    async def housekeeping() -> None:
        """Trim what every consumer group has acknowledged, every ``run.trim_interval_s`` (0: never)."""
        streams = [s.events, s.control, s.replies(coord.name)] + [
            f(a) for a in cfg.agents for f in (s.turns, s.samples, s.batches, s.weights)]
        if cfg.run.trim_interval_s == 0:
            return await stop.wait()
        while not stop.is_set():
            await asyncio.sleep(cfg.run.trim_interval_s)
            for name in streams:
                await bus.trim_acknowledged(name)

    async def run_and_report() -> None:
        await coord.run()
        path = await asyncio.to_thread(write_report, coord.state, coord.evals, cfg.run_dir(), time.time() - started)
        await run_logger.close(coord)  # after the report: the logs hold at least what it holds
        log.info("report written to %s", path)
        await bus.publish(s.control, Control(command="stop", args={"reason": coord.state.phase}))
        server.should_exit = True

    loops = [
        bus.consume(s.replies(coord.name), "coordinator", coord.name, GenerateReply, coord.on_reply, stop,
                    concurrency=1, count=64),
        bus.consume(s.events, "coordinator", coord.name, Event, coord.on_event, stop),
        watch_control(bus, "control-coordinator", stop, on_control, stop_on_stop=False),
        server.serve(),
        housekeeping(),
        run_logger.follow(coord, stop),
    ]
    runner = asyncio.ensure_future(run_and_report())
    await run_service("coordinator", bus, stop, *loops, runner)
    ok = runner.done() and not runner.cancelled() and runner.exception() is None and coord.state.error is None
    return 0 if ok else 1


def main() -> None:
    args = parse_args("coordinator", per_agent=False,
                      extra=lambda p: p.add_argument("--port", type=int, default=None))
    raise SystemExit(asyncio.run(main_async(args.config, args.port)))


if __name__ == "__main__":
    main()
