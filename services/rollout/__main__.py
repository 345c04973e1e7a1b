"""Rollout entry point: ``python -m services.rollout --config C --agent A --router URL``.

Two loops: generation requests from ``turns:{agent}`` go to the agent's SGLang
router (``/generate`` with input_ids, sampling_params, return_logprob) and the
token-exact reply goes to the requester's reply stream; new weights from
``weights:{agent}`` are loaded on every engine the router knows, after which
a ``weights_loaded`` event is published.
"""

from __future__ import annotations

import asyncio

from services.common.bus import Bus, RetryLater
from services.common.service import load_or_exit, parse_args, run_service, setup_logging, watch_control
from services.common.sglang_router import list_workers
from services.contracts.messages import Event, GenerateReply, GenerateRequest, WeightsUpdate
from services.rollout.engine_client import EngineClient, EngineClientError

RETRIES = 5


async def main_async(config: str, agent: str, router_url: str) -> int:
    log = setup_logging(f"rollout.{agent}")
    cfg = load_or_exit(config, agent)
    acfg = cfg.agents[agent]
    bus = Bus(cfg.redis_url, cfg.run.name, f"rollout-{agent}")
    s = bus.streams
    client = EngineClient(router_url, timeout=120.0)
    stop = asyncio.Event()

    async def on_turn(req: GenerateRequest) -> None:
        if req.agent != agent:
            raise ValueError(f"request for agent {req.agent!r} on the turns stream of {agent!r}")
        sampling = req.sampling.model_dump(exclude={"seed"}) | (
            {"sampling_seed": req.sampling.seed} if req.sampling.seed is not None else {})
        for attempt in range(RETRIES):
            try:
                res = await client.generate(req.input_ids, sampling, rid=req.id)
                if res.finish_reason == "abort":  # aborted on the engine: not a trajectory to train on
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
        engines = await list_workers(router_url)
        if not engines:
            raise RetryLater(f"the router lists no engine to load version {w.version} on")
        await asyncio.gather(*(client.update_weights(url, w.path, w.version) for url in engines))
        await bus.redis.set(s.loaded_version(agent), w.version)
        await bus.publish(s.events, Event(source=bus.service, kind="weights_loaded", agent=agent,
                                          data={"version": w.version, "engines": engines, "path": w.path}))
        log.info("version %d loaded on %d engine(s)", w.version, len(engines))

    inflight = acfg.num_engines * acfg.max_inflight_per_engine
    await run_service(f"rollout.{agent}", bus, stop,
                      bus.consume(s.turns(agent), "rollout", bus.service, GenerateRequest, on_turn, stop,
                                  concurrency=inflight, count=64),
                      bus.consume(s.weights(agent), "rollout", bus.service, WeightsUpdate, on_weights, stop),
                      watch_control(bus, f"control-rollout-{agent}", stop))
    await client.aclose()
    return 0


def main() -> None:
    args = parse_args("rollout", per_agent=True,
                      extra=lambda p: p.add_argument("--router", required=True, help="the agent's router URL"))
    raise SystemExit(asyncio.run(main_async(args.config, args.agent, args.router)))


if __name__ == "__main__":
    main()
