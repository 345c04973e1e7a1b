"""The rollout service: one handler per stream (``on_turn``, ``on_weights``) and the load report.

The rollout reaches its engines through one interface (``external.Engines``), managed in one of two ways.
Owning (``fleet.EngineFleet``): without a router URL it starts the real SGLang router and the agent's
``num_engines`` engines as child processes, registers them at run time, health-checks and restarts them,
and restores the adapters of the agents that share them (``share_engines_with``) on a restarted engine.
External (``external.ExternalRouter``): with a router URL (``--router``), or for an agent whose config
says ``share_engines_with: A`` (then A's router, on ``agents.A.router_port``), it drives a router someone
else manages and loads its weights on the workers that router lists. The external mode stays because the
shared-base topology uses it in every ``tandem up`` run that shares: two agents' turns on one fleet, one
base, each agent's own adapters, and each rollout keeps its own version gating, staleness, signatures and
loaded-version bookkeeping.

``on_turn``: a generation request from ``turns:{agent}`` goes to the router (``/generate`` with
input_ids, sampling_params, return_logprob; the turns of one bus read that share sampling parameters go
together as one batch call: batcher.py), at most ``max_inflight_per_engine`` per healthy engine
at a time, and the token-exact reply goes to the requester's reply stream. A reply whose ids fall
outside the agent's vocabulary or whose logprobs are not finite and <= 0 (a misbehaving engine) is not
passed on: the requester gets an error reply and the turn is rejected with the reason. ``on_weights``: new
weights from ``weights:{agent}`` are loaded on every engine, then ``weights_loaded`` is published; only
an authentic update is loaded (signed with the run's secret, a version the trainer committed, files that
match its checksum: ``weights_auth.refusal``), anything else is rejected with the reason and the engines
keep the weights they had. A LoRA version (an adapter directory) is loaded on the engines' resident base
(``adapters.AdapterSync``), and every turn is then sent naming it (``lora_path``) and records its version.
``report_load``: every ``LOAD_EVERY_S`` the queue depth and per-engine load go to ``events`` as
``rollout_load``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable

from services.common.admin_token import token_from_env
from services.common.bus import Bus, Reject, RetryLater
from services.common.tokens import ids_problem, logprobs_problem, vocab_size
from services.common.weights_auth import WeightsProof, refusal, run_secret
from services.contracts.config import ConfigError, TandemConfig
from services.contracts.messages import (
    EngineStatus,
    GenerateReply,
    GenerateRequest,
    RolloutLoad,
    WeightsLoaded,
    WeightsUpdate,
)
from services.contracts.sharing import fleet_owner, sharers
from services.rollout.adapters import publish_kept, read_kept
from services.rollout.batcher import TurnBatcher
from services.rollout.engine_client import EngineClient, EngineClientError, GenerateResult
from services.rollout.external import Engines, ExternalRouter
from services.rollout.fleet import EngineFleet
from services.rollout.limiter import InflightLimiter
from services.rollout.spawn import Spawned

RETRIES = 5
HOLD_FOR_FLEET_S = 180.0  # how long a failing turn is retried while the fleet recovers an engine
LOAD_EVERY_S = 2.0
log = logging.getLogger("tandem.rollout")


class RolloutService:
    """One agent's rollout. Build it with ``start`` (engines up, resumed weights), wire the handlers, ``close``."""

    def __init__(self, cfg: TandemConfig, agent: str, bus: Bus, router_url: str,
                 fleet: EngineFleet | None = None) -> None:
        """``fleet``: the engines this rollout owns; without one it drives the router at ``router_url``."""
        self.acfg = cfg.agents[agent]
        self.agent, self.bus, self.router_url, self.fleet = agent, bus, router_url, fleet
        self.num_engines = cfg.agents[fleet_owner(cfg.agents, agent)].num_engines  # of the fleet its turns use
        sharing = self.acfg.share_engines_with is not None
        self.pool: Engines = fleet if fleet is not None else ExternalRouter(
            agent, router_url, token_from_env(), self.num_engines, shared=sharing,
            record=(lambda kept: publish_kept(bus.redis, bus.streams, agent, kept)) if sharing else None)
        self.token = self.pool.token  # the run's admin token
        per_engine = self.acfg.max_inflight_per_engine
        self.limiter = InflightLimiter(lambda: per_engine * self.engines())
        client = EngineClient(router_url, timeout=120.0, token=self.token, engines=self.engine_urls)
        self.batcher = TurnBatcher(client, self.engines, max_batch=per_engine)
        self.vocab = vocab_size(self.acfg.model_path)
        self.sync = self.pool.sync  # the adapter versions the engines hold, and the one turns go under

    @classmethod
    async def start(cls, cfg: TandemConfig, agent: str, bus: Bus, router_url: str | None,
                    early: Spawned | None = None) -> RolloutService:
        """With no ``router_url``, start the agent's router and engines (or adopt those ``early`` started) and
        put them on the loaded version; an agent sharing another's engines drives that agent's router."""
        router_url = router_url or shared_router_url(cfg, agent)
        if router_url is not None:
            service = cls(cfg, agent, bus, router_url)
            await resume_weights(bus, agent, service.pool)
            return service
        others = sharers(cfg.agents, agent)
        fleet = EngineFleet(agent, cfg.agents[agent], early=early, shared_with=tuple(others),
                            shared=(lambda: read_kept(bus.redis, bus.streams, others)) if others else None)
        try:
            await fleet.start()
            await resume_weights(bus, agent, fleet)
        except BaseException:
            await fleet.close()
            raise
        return cls(cfg, agent, bus, fleet.router_url, fleet)

    @property
    def client(self) -> EngineClient:
        """The router's client for turns (the batcher's)."""
        return self.batcher.client

    @client.setter
    def client(self, client: EngineClient) -> None:
        self.batcher.client = client

    def engines(self) -> int:
        """How many engines take turns now: the fleet's healthy ones, or the configured number."""
        return self.pool.healthy()

    async def engine_urls(self) -> list[str]:
        """Every engine's URL (the fleet's, or those the external router lists): where a timed-out call's
        requests are aborted."""
        return await self.pool.engine_urls()

    @property
    def concurrency(self) -> int:
        """How many turns the turns stream's consumer handles at once."""
        return self.num_engines * self.acfg.max_inflight_per_engine

    def recovering(self) -> bool:
        """Whether a failing turn is held for the engines to come back: the fleet is recovering an engine, or
        (sharing another agent's fleet) its owner's rollout supervises and restarts what failed."""
        return self.pool.recovering()

    def background(self, stop: asyncio.Event) -> list[Awaitable[None]]:
        """Loops that run beside the handlers: the load report, and the engines' supervision."""
        return [self.report_load(stop), self.pool.supervise(stop)]

    async def close(self) -> None:
        await self.batcher.aclose()
        await self.client.aclose()
        await self.pool.close()

    # --- handlers ---------------------------------------------------------------------
    async def on_turn(self, req: GenerateRequest) -> None:
        if req.agent != self.agent:
            raise Reject(f"request for agent {req.agent!r} on the turns stream of {self.agent!r}")
        try:
            self.bus.flow(req.reply_stream)
        except (ValueError, KeyError) as exc:
            raise Reject(f"reply_stream {req.reply_stream!r}: {exc}") from exc
        res = await self.generate(req)
        problem = self.reply_problem(res)
        if problem is not None:
            await self.answer_error(req, f"engine {res.engine or self.router_url}: {problem}")
            raise Reject(f"engine {res.engine or self.router_url} answered {req.id} wrongly: {problem}")
        await self.bus.publish(req.reply_stream, GenerateReply(
            request_id=req.id, agent=self.agent, episode_id=req.episode_id, turn=req.turn,
            output_ids=res.output_ids, output_logprobs=res.output_logprobs, finish_reason=res.finish_reason,
            weight_version=res.weight_version, engine=res.engine or self.router_url, prompt_tokens=res.prompt_tokens))

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """The router's answer, retried with backoff; a request the engine rejects is answered with the error
        and then rejected; a router down for every retry leaves the turn pending (RetryLater). While the fleet
        is recovering an engine (hung or restarting), retries go on for up to ``HOLD_FOR_FLEET_S``: the turn is
        generated once the engine is back, not after the bus's reclaim idle time (which a hung engine's long
        handlers raise to minutes)."""
        sampling = req.sampling.model_dump(exclude={"seed"}) | (
            {"sampling_seed": req.sampling.seed} if req.sampling.seed is not None else {})
        started = time.monotonic()
        for attempt in itertools.count():
            try:
                served = self.sync.serving()  # the adapter this attempt is generated under (None: the base)
                async with self.limiter:
                    res = await self.batcher.generate(req.input_ids, sampling, rid=req.id,
                                                      lora=served.name if served else None)
                if res.finish_reason == "abort":  # aborted on the engine (e.g. it died): not a trajectory
                    raise EngineClientError(f"generate {req.id}: aborted: {res.finish_message}")
                if served is not None:  # exactly the adapter version it was sent under
                    res = dataclasses.replace(res, weight_version=served.version,
                                              weight_versions=((served.version, 0, len(res.output_ids)),))
                return res
            except EngineClientError as exc:
                if exc.request_rejected:  # the request itself is bad: answer, then dead-letter it
                    await self.answer_error(req, str(exc))
                    raise Reject(str(exc)) from exc
                held = self.recovering() and time.monotonic() - started < HOLD_FOR_FLEET_S
                if attempt + 1 >= RETRIES and not held:
                    break
                if attempt < RETRIES or attempt % 10 == 0:
                    log.warning("generate failed (attempt %d%s): %s", attempt + 1,
                                ", held while an engine recovers" if held else "", exc)
                await asyncio.sleep(min(0.2 * 2 ** attempt, 2.0))
        raise RetryLater("router unavailable")

    def reply_problem(self, res: GenerateResult) -> str | None:
        """Why the engine's reply is unusable (ids outside the vocabulary, logprobs not finite or > 0), or None."""
        if len(res.output_ids) != len(res.output_logprobs):
            return f"{len(res.output_ids)} output ids but {len(res.output_logprobs)} logprobs"
        return (ids_problem(res.output_ids, self.vocab, "output_ids")
                or logprobs_problem(res.output_logprobs, "output_logprobs"))

    async def answer_error(self, req: GenerateRequest, error: str) -> None:
        """Answer the requester with an error reply (no tokens), so its turn fails now rather than times out."""
        await self.bus.publish(req.reply_stream, GenerateReply(
            request_id=req.id, agent=self.agent, episode_id=req.episode_id, turn=req.turn, output_ids=[],
            output_logprobs=[], finish_reason="abort", weight_version=-1, engine=self.router_url, error=error))

    async def on_weights(self, w: WeightsUpdate) -> None:
        agent, s = self.agent, self.bus.streams
        if w.agent != agent:
            raise Reject(f"weights of agent {w.agent!r} on the weights stream of {agent!r}")
        loaded = await self.bus.redis.get(s.loaded_weight_version(agent))
        if loaded is not None and w.weight_version < int(loaded):  # a replayed or late old update never rolls back
            raise Reject(f"weights version {w.weight_version} is older than the loaded version {int(loaded)} "
                         "(a replay or a late redelivery): the engines keep what they have")
        why = await refusal(self.bus.redis, s, run_secret(), w)
        if why is not None:
            raise Reject(f"weights version {w.weight_version} at {w.path} refused: {why}")
        engines = await self.pool.load_weights(w.path, w.weight_version, proof=WeightsProof.of(w))
        if not engines:
            raise RetryLater(f"no engine is up to load version {w.weight_version} on")
        async with self.bus.redis.pipeline(transaction=True) as pipe:
            pipe.set(s.loaded_weight_version(agent), w.weight_version)
            pipe.set(s.loaded_weights(agent), w.model_dump_json())
            await pipe.execute()
        await self.bus.publish(s.events, WeightsLoaded(source=self.bus.service, agent=agent,
                                                       weight_version=w.weight_version, engines=engines, path=w.path))
        log.info("version %d loaded on %d engine(s)", w.weight_version, len(engines))

    # --- the load report --------------------------------------------------------------
    async def report_load(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.publish_load()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), LOAD_EVERY_S)

    async def publish_load(self) -> None:
        s = self.bus.streams
        depth = 0
        with contextlib.suppress(Exception):  # the group may not exist yet
            for g in await self.bus.redis.xinfo_groups(s.turns(self.agent)):
                if g["name"] in (b"rollout", "rollout"):
                    depth = int(g.get("lag") or 0) + int(g.get("pending") or 0)
        engines = [EngineStatus(**e) for e in await self.pool.status()]
        await self.bus.publish(s.events, RolloutLoad(
            source=self.bus.service, agent=self.agent, queue_depth=depth, inflight=self.limiter.inflight,
            capacity=self.limiter.capacity(), waiting=self.limiter.waiting, router=self.router_url, engines=engines,
            router_restarts=self.pool.router_restarts))


async def resume_weights(bus: Bus, agent: str, fleet: Engines) -> None:
    """A restarted rollout goes on from the version the agent had loaded before, when it is authentic: its
    fresh fleet loads it; an external router's workers, which outlive the rollout, are named it again."""
    raw = await bus.redis.get(bus.streams.loaded_weights(agent))
    if raw is None:
        return
    try:
        w = WeightsUpdate.model_validate_json(raw)
    except ValueError as exc:
        log.warning("cannot resume the loaded weights (%s): engines start on the base model", exc)
        return
    why = await refusal(bus.redis, bus.streams, run_secret(), w)
    if why is not None:
        log.warning("not resuming weights version %d (%s): engines start on the base model", w.weight_version, why)
        return
    await fleet.resume(w.path, w.weight_version, WeightsProof.of(w))
    log.info("resumed on version %d", w.weight_version)


def shared_router_url(cfg: TandemConfig, agent: str) -> str | None:
    """The router of the fleet an agent sharing another's engines drives (that agent's ``router_port`` on this
    host: ``tandem up`` fixes it), or None for an agent that owns its engines."""
    owner = fleet_owner(cfg.agents, agent)
    if owner == agent:
        return None
    port = cfg.agents[owner].router_port
    if not port:
        raise ConfigError(f"agents.{agent}.share_engines_with: agents.{owner}.router_port is 0, so {agent}'s rollout "
                          f"cannot find {owner}'s router: give it a port, or start the rollout with --router URL")
    return f"http://127.0.0.1:{port}"
