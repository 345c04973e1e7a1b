"""Buffer entry point: ``python -m services.buffer --config C --agent A``."""

from __future__ import annotations

import asyncio

from services.buffer.store import GroupVerdict, SampleStore
from services.common.bus import Bus
from services.common.service import load_or_exit, parse_args, run_service, setup_logging, watch_control
from services.contracts.messages import Event, Sample


async def main_async(config: str, agent: str) -> int:
    log = setup_logging(f"buffer.{agent}")
    cfg = load_or_exit(config, agent)
    acfg = cfg.agents[agent]
    bus = Bus(cfg.redis_url, cfg.run.name, f"buffer-{agent}")
    store = SampleStore(bus, agent, acfg.groups_per_batch, acfg.max_staleness, acfg.filter_zero_variance,
                        max_batches=cfg.run.total_steps)
    stop = asyncio.Event()

    async def report(v: GroupVerdict) -> None:
        await bus.publish(bus.streams.events, Event(source=bus.service, kind="group_done", agent=agent,
                                                    data={"group_id": v.group_id, "kept": v.kept,
                                                          "outcome": v.outcome, "reason": v.reason,
                                                          "was_kept": v.was_kept}))

    async def release() -> None:
        batches, dropped = await store.release()
        for v in dropped:
            await report(v)
        for b in batches:
            log.info("released batch for step %d: %d samples", b.step, len(b.samples))
            await bus.publish(bus.streams.events, Event(source=bus.service, kind="batch_released", agent=agent,
                                                        data={"step": b.step, "samples": len(b.samples)}))

    async def on_sample(sample: Sample) -> None:
        verdict = await store.add(sample)
        if verdict is not None:
            await report(verdict)
            await release()

    async def abandon_overdue() -> None:  # the group timeout: a group missing a sample is abandoned
        while not stop.is_set():
            for v in await store.abandon_overdue(cfg.run.group_timeout_s):
                log.warning("group %s abandoned: %s", v.group_id, v.reason)
                await report(v)
            await asyncio.sleep(min(5.0, cfg.run.group_timeout_s / 4))

    await release()  # a restart may find complete groups waiting
    await run_service(f"buffer.{agent}", bus, stop,
                      bus.consume(bus.streams.samples(agent), "buffer", bus.service, Sample, on_sample, stop),
                      watch_control(bus, f"control-buffer-{agent}", stop), abandon_overdue())
    return 0


def main() -> None:
    args = parse_args("buffer", per_agent=True)
    raise SystemExit(asyncio.run(main_async(args.config, args.agent)))


if __name__ == "__main__":
    main()
