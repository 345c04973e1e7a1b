"""Rollout entry point: ``python -m services.rollout --config C --agent A [--router URL]``.

Without ``--router`` the rollout owns its engines: it starts the real SGLang router and the
agent's ``num_engines`` engines as child processes, registers them at run time, health-checks and
restarts them (``fleet.EngineFleet``). With ``--router`` it drives an externally managed router and
loads weights on the workers that router lists.

Loops: generation requests from ``turns:{agent}`` go to the router (``/generate`` with input_ids,
sampling_params, return_logprob), at most ``max_inflight_per_engine`` per healthy engine at a
time, and the token-exact reply goes to the requester's reply stream; new weights from
``weights:{agent}`` are loaded on every engine, then ``weights_loaded`` is published; every
``LOAD_EVERY_S`` the queue depth and per-engine load go to ``events`` as ``rollout_load``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from services.common.bus import Bus, RetryLater
from services.common.service import load_or_exit, parse_args, run_service, setup_logging, watch_control
from services.common.sglang_router import list_workers
from services.contracts.messages import Event, GenerateReply, GenerateRequest, WeightsUpdate
from services.rollout.engine_client import EngineClient, EngineClientError
from services.rollout.fleet import EngineFleet
from services.rollout.limiter import InflightLimiter

RETRIES = 5
LOAD_EVERY_S = 2.0


async def main_async(config: str, agent: str, router_url: str | None) -> int:
    log = setup_logging(f"rollout.{agent}")
    cfg = load_or_exit(config, agent)
    acfg = cfg.agents[agent]
    bus = Bus(cfg.redis_url, cfg.run.name, f"rollout-{agent}")
    s = bus.streams
    fleet = None if router_url else EngineFleet(agent, acfg)
    if fleet is not None:
        try:
            await fleet.start()
            await resume_weights(bus, agent, fleet, log)
        except BaseException:
            await fleet.close()
            raise
        router_url = fleet.router_url
    assert router_url is not None
    client = EngineClient(router_url, timeout=120.0)
    per_engine = acfg.max_inflight_per_engine
    limiter = InflightLimiter(lambda: per_engine * (fleet.healthy() if fleet else acfg.num_engines))
    stop = asyncio.Event()

    async def on_turn(req: GenerateRequest) -> None:
        if req.agent != agent:
            raise ValueError(f"request for agent {req.agent!r} on the turns stream of {agent!r}")
        sampling = req.sampling.model_dump(exclude={"seed"}) | (
            {"sampling_seed": req.sampling.seed} if req.sampling.seed is not None else {})
        for attempt in range(RETRIES):
            try:
                async with limiter:
                    res = await client.generate(req.input_ids, sampling, rid=req.id)
                if res.finish_reason == "abort":  # aborted on the engine (e.g. it died): not a trajectory
                    raise EngineClientError(f"generate {req.id}: aborted: {res.finish_message}")
                break
            except EngineClientError as exc:
                if exc.request_rejected:  # the request itself is bad: answer, then dead-letter it
                    await bus.publish(req.reply_stream, GenerateReply(
                        request_id=req.id, agent=agent, episode_id=req.episode_id, turn=req.turn, output_ids=[],
                        output_logprobs=[], finish_reason="abort", weight_version=-1, engine=router_url,
                        error=str(exc)))
                    raise ValueError(str(exc)) from exc
                log.warning("generate failed (attempt %d): %s", attempt + 1, exc)
                await asyncio.sleep(0.2 * 2 ** attempt)
        else:
            raise RetryLater("router unavailable")
        await bus.publish(req.reply_stream, GenerateReply(
            request_id=req.id, agent=agent, episode_id=req.episode_id, turn=req.turn,
            output_ids=res.output_ids, output_logprobs=res.output_logprobs, finish_reason=res.finish_reason,
            weight_version=res.weight_version, engine=res.engine or router_url, prompt_tokens=res.prompt_tokens))

    async def on_weights(w: WeightsUpdate) -> None:
        if w.agent != agent:
            raise ValueError(f"weights of agent {w.agent!r} on the weights stream of {agent!r}")
        loaded = await bus.redis.get(s.loaded_version(agent))
        if loaded is not None and w.version < int(loaded):  # a redelivered old update never rolls engines back
            log.warning("version %d arrived after version %s was loaded: skipped", w.version, int(loaded))
            return
        if fleet is not None:
            engines = await fleet.load_weights(w.path, w.version)
        else:
            engines = await list_workers(router_url)
            await asyncio.gather(*(client.update_weights(url, w.path, w.version) for url in engines))
        if not engines:
            raise RetryLater(f"no engine is up to load version {w.version} on")
        async with bus.redis.pipeline(transaction=True) as pipe:
            pipe.set(s.loaded_version(agent), w.version)
            pipe.set(s.loaded_weights(agent), w.model_dump_json())
            await pipe.execute()
        await bus.publish(s.events, Event(source=bus.service, kind="weights_loaded", agent=agent,
                                          data={"version": w.version, "engines": engines, "path": w.path}))
        log.info("version %d loaded on %d engine(s)", w.version, len(engines))

    async def report_load() -> None:
        while not stop.is_set():
            depth = 0
            with contextlib.suppress(Exception):  # the group may not exist yet
                for g in await bus.redis.xinfo_groups(s.turns(agent)):
                    if g["name"] in (b"rollout", "rollout"):
                        depth = int(g.get("lag") or 0) + int(g.get("pending") or 0)
            engines: list[dict[str, Any]] = fleet.snapshot() if fleet else []
            if fleet is None:
                with contextlib.suppress(httpx.HTTPError, RuntimeError):  # an external router may be down a while
                    engines = [{"url": u, "healthy": True} for u in await list_workers(router_url)]
            await bus.publish(s.events, Event(source=bus.service, kind="rollout_load", agent=agent, data={
                "queue_depth": depth, "inflight": limiter.inflight, "capacity": limiter.capacity(),
                "waiting": limiter.waiting, "router": router_url, "engines": engines}))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), LOAD_EVERY_S)

    loops = [bus.consume(s.turns(agent), "rollout", bus.service, GenerateRequest, on_turn, stop,
                         concurrency=acfg.num_engines * per_engine, count=64),
             bus.consume(s.weights(agent), "rollout", bus.service, WeightsUpdate, on_weights, stop),
             watch_control(bus, f"control-rollout-{agent}", stop), report_load()]
    try:
        await run_service(f"rollout.{agent}", bus, stop, *loops, *([fleet.supervise(stop)] if fleet else []))
    finally:
        await client.aclose()
        if fleet is not None:
            await fleet.close()
    return 0


async def resume_weights(bus: Bus, agent: str, fleet: EngineFleet, log: logging.Logger) -> None:
    """A restarted rollout puts its fresh engines on the version the agent had loaded before."""
    raw = await bus.redis.get(bus.streams.loaded_weights(agent))
    if raw is None:
        return
    try:
        w = WeightsUpdate.model_validate_json(raw)
    except ValueError as exc:
        log.warning("cannot resume the loaded weights (%s): engines start on the base model", exc)
        return
    await fleet.load_weights(w.path, w.version)
    log.info("resumed on version %d", w.version)


def main() -> None:
    args = parse_args("rollout", per_agent=True, extra=lambda p: p.add_argument(
        "--router", default=None, help="an externally managed router's URL (then no engines are started here)"))
    raise SystemExit(asyncio.run(main_async(args.config, args.agent, args.router)))


if __name__ == "__main__":
    main()
