"""The coordinator's run: evaluation, gated group launches, sample emission, the end.

Main loop (``Coordinator.run``): evaluate every agent against the env's
scripted opponent; launch GRPO groups while the staleness gate allows (see
state.py) and the run is not paused; when every agent has loaded its last
version, evaluate again, write the report and tell all services to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from typing import Any

from transformers import AutoTokenizer

from services.common.bus import Bus
from services.contracts.config import TandemConfig
from services.contracts.messages import Control, Event, GenerateReply, GenerateRequest, SamplingParams, new_id
from services.coordinator.dashboard.transcripts import save_tokens
from services.coordinator.episode import EpisodeResult, play_episode
from services.coordinator.evaluation import eval_roles, evaluate_player
from services.coordinator.local_policy import POLICY, LocalPolicies, context_length
from services.coordinator.state import RunState
from services.envs.registry import check_environment_config

log = logging.getLogger("tandem.coordinator")


def finite(data: dict[str, Any]) -> dict[str, Any]:
    """Metrics with NaN/inf replaced by None (JSON cannot carry them)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()}

TURN_TIMEOUT_S = 300.0
ENGINE_WAIT_S = 1800.0  # SGLang engines can take minutes to load a real model
MAX_EMPTY_GROUPS = 50
EPISODE_CACHE = 2000


class Coordinator:
    def __init__(self, cfg: TandemConfig, bus: Bus, name: str = "coordinator") -> None:
        self.cfg, self.bus, self.name = cfg, bus, name
        self.state = RunState.from_config(cfg)
        self.env_cls = check_environment_config(cfg.environment)
        self.tokenizers: dict[str, Any] = {a: AutoTokenizer.from_pretrained(c.model_path)
                                           for a, c in cfg.agents.items()}
        self.local = LocalPolicies()
        self.context: dict[str, int] = {a: context_length(c.model_path) for a, c in cfg.agents.items()}
        # opponent pool: each agent's weight versions as they load (version 0 is the start model)
        self.versions: dict[str, list[str]] = {a: [c.model_path] for a, c in cfg.agents.items()}
        self.pool_rng = random.Random(cfg.run.seed)
        self.reply_stream = bus.streams.replies(name)
        self.pending: dict[str, asyncio.Future[GenerateReply]] = {}
        self.changed = asyncio.Condition()
        self.slots = asyncio.Semaphore(cfg.run.concurrent_episodes)
        self.episodes: dict[str, dict[str, Any]] = {}
        self.evals: list[dict[str, Any]] = []
        self.group_tasks: set[asyncio.Task[None]] = set()
        self.eval_task: asyncio.Task[dict[str, float]] | None = None
        self.empty_streak: dict[str, int] = {}
        self.engines_ready: set[str] = set()  # agents whose rollout reports a healthy engine

    # --- plumbing -----------------------------------------------------------
    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def generate(self, req: GenerateRequest) -> GenerateReply:
        if req.agent.startswith(POLICY):
            return await self.local.generate(req)
        fut: asyncio.Future[GenerateReply] = asyncio.get_running_loop().create_future()
        self.pending[req.id] = fut
        try:
            await self.bus.publish(self.bus.streams.turns(req.agent), req)
            return await asyncio.wait_for(fut, TURN_TIMEOUT_S)
        finally:
            self.pending.pop(req.id, None)

    async def on_reply(self, reply: GenerateReply) -> None:
        fut = self.pending.get(reply.request_id)
        if fut is not None and not fut.done():
            if reply.error:
                fut.set_exception(RuntimeError(f"generation failed: {reply.error}"))
            else:
                fut.set_result(reply)

    async def on_event(self, ev: Event) -> None:
        if ev.kind == "weights_loaded" and ev.agent in self.versions and ev.data.get("path"):
            if ev.data["path"] not in self.versions[ev.agent]:
                self.versions[ev.agent].append(str(ev.data["path"]))
        if ev.kind == "rollout_load" and ev.agent and ev.agent not in self.engines_ready and any(
                e.get("healthy") for e in ev.data.get("engines", [])):
            self.engines_ready.add(ev.agent)  # frozen agents too: they have no AgentState
            await self.notify()
        agent = self.state.agents.get(ev.agent or "")
        if agent is None:
            return
        if ev.kind == "weights_loaded":
            version = int(ev.data["version"])
            agent.loaded_version = max(agent.loaded_version, version)
            if version not in agent.versions_loaded:
                agent.versions_loaded.append(version)
        elif ev.kind == "train_step" and ("version" not in ev.data
                                          or all(t.get("version") != ev.data["version"] for t in agent.train_steps)):
            agent.train_steps.append({**finite(ev.data), "time": ev.created_at})  # once per version (re-sends)
        elif ev.kind == "rollout_load":
            agent.rollout = dict(ev.data)
        elif ev.kind == "group_done":
            agent.resolve_group(str(ev.data.get("group_id")), "kept" if ev.data.get("kept") else "dropped")
        await self.notify()

    async def control(self, command: str, publish: bool = True) -> None:
        """pause / resume / stop the run. ``stop`` ends it gracefully: no new groups, the
        report is written, and only then are the other services told to stop."""
        if command == "pause":
            self.state.paused = True
        elif command == "resume":
            self.state.paused = False
        elif command == "stop":
            self.state.stop_requested = True
        if publish and command != "stop":
            await self.bus.publish(self.bus.streams.control, Control(command=command))  # type: ignore[arg-type]
        await self.notify()

    async def record(self, result: EpisodeResult) -> None:
        rec = result.record()
        self.episodes[result.episode_id] = rec
        if len(self.episodes) > EPISODE_CACHE:
            self.episodes.pop(next(iter(self.episodes)))
        await self.bus.redis.hset(self.bus.streams.episodes(), result.episode_id, json.dumps(rec))
        await save_tokens(self.bus, result)  # each reply's tokens and logprobs, for the dashboard
        self.state.episodes_done += 1
        self.state.episode_times.append(time.time())

    async def _play(self, env: Any, group_id: str, roles: dict[str, str], purpose: str,
                    sampling: dict[str, SamplingParams], rng: random.Random | None = None) -> EpisodeResult | None:
        async with self.slots:
            try:
                for player in roles.values():  # a pool version seen for the first time: read it off the loop
                    if player.startswith(POLICY) and player not in self.tokenizers:
                        path = player[len(POLICY):]
                        self.context[player] = await asyncio.to_thread(context_length, path)
                        self.tokenizers[player] = await asyncio.to_thread(self.local.tokenizer, path)
                result = await play_episode(env, new_id(), group_id, roles, self.tokenizers, sampling,
                                            self.generate, self.reply_stream, purpose, rng, self.context)
            except Exception as exc:  # an env bug or a lost turn abandons one episode, not the run
                log.warning("episode of group %s abandoned: %r", group_id, exc)
                return None
        await self.record(result)
        return result

    # --- training groups ----------------------------------------------------
    def roles_for_group(self, index: int) -> dict[str, str]:
        env_cfg = self.cfg.environment
        roles = list(env_cfg.roles)
        agents = [env_cfg.roles[r] for r in roles]
        if env_cfg.alternate_roles:
            k = index % len(agents)
            agents = agents[k:] + agents[:k]
        return dict(zip(roles, agents, strict=True))

    def resolve_pool(self, roles: dict[str, str]) -> dict[str, str]:
        """``pool:<agent>`` becomes one of that agent's last ``pool_size`` versions, drawn per group."""
        out = {}
        for role, player in roles.items():
            if player.startswith("pool:"):
                recent = self.versions[player[len("pool:"):]][-self.cfg.environment.pool_size:]
                player = POLICY + self.pool_rng.choice(recent)
            out[role] = player
        return out

    def trained(self, roles: dict[str, str]) -> set[str]:
        """The agents that train on a group played with ``roles``."""
        return {p for p in roles.values() if p in self.state.agents}

    def may_launch(self, roles: dict[str, str]) -> bool:
        wanting = [self.state.agents[a] for a in self.trained(roles) if self.state.agents[a].wants_groups()]
        return bool(wanting) and not any(a.blocked_by_staleness() for a in wanting)

    async def run_group(self, index: int, roles: dict[str, str]) -> None:
        env_cfg = self.cfg.environment
        group_id = f"g{index:06d}-{new_id()[:8]}"
        agents = self.trained(roles)
        roles = self.resolve_pool(roles)
        emitted: set[str] = set()
        try:
            envs = self.env_cls.make_group(env_cfg.params, self.cfg.run.seed * 1_000_003 + index,
                                           env_cfg.group_size)
            sampling = self.sampling_for(roles)
            results = await asyncio.gather(*(self._play(e, group_id, roles, "train", sampling) for e in envs))
            done = [r for r in results if r is not None]
            counts = {a: sum(1 for r in done for v in r.views.values() if v.agent == a and any(v.mask))
                      for a in agents}
            rewards: dict[str, list[float]] = {a: [] for a in agents}
            for r in done:
                for sample in r.samples(counts):
                    await self.bus.publish(self.bus.streams.samples(sample.agent), sample)
                    emitted.add(sample.agent)
                    rewards[sample.agent].append(sample.reward)
            for agent, rs in rewards.items():
                if rs:
                    self.state.agents[agent].group_rewards.append((time.time(), sum(rs) / len(rs)))
        except Exception:
            log.exception("group %s failed", group_id)
        finally:  # an agent with nothing in this group gets no verdict from its buffer
            for agent in agents - emitted:
                self.state.agents[agent].resolve_group(group_id, "empty")
            self.check_starved(agents, emitted)
            await self.notify()

    def check_starved(self, agents: set[str], emitted: set[str]) -> None:
        """Stop the run when an agent got no turn in MAX_EMPTY_GROUPS groups in a row: with these
        players the environment never lets it act (say, a counterpart whose replies never parse),
        and waiting for its batches would never end."""
        for agent in agents:
            streak = 0 if agent in emitted else self.empty_streak.get(agent, 0) + 1
            self.empty_streak[agent] = streak
            if streak >= MAX_EMPTY_GROUPS and not self.state.stop_requested:
                self.state.error = (f"agent {agent} had no turn in {streak} groups in a row: the environment "
                                    "never lets it act with these players; stopping the run")
                log.error(self.state.error)
                self.state.stop_requested = True

    async def training_loop(self) -> None:
        self.state.phase = "training"
        while not self.state.stop_requested:
            roles = self.roles_for_group(self.state.groups_launched)
            async with self.changed:
                await self.changed.wait_for(lambda r=roles: self.state.stop_requested or self.all_finished() or (
                    not self.state.paused and self.may_launch(r)))
            if self.state.stop_requested or self.all_finished():
                break
            for agent in self.trained(roles):
                self.state.agents[agent].in_flight_groups += 1
            task = asyncio.create_task(self.run_group(self.state.groups_launched, roles))
            self.group_tasks.add(task)
            task.add_done_callback(self.group_tasks.discard)
            self.state.groups_launched += 1

    def all_finished(self) -> bool:
        return all(a.finished for a in self.state.agents.values())

    # --- evaluation ---------------------------------------------------------
    async def evaluate(self, agent: str) -> dict[str, Any]:
        env_cfg = self.cfg.environment
        ev = env_cfg.eval

        async def play(env: Any, gid: str, mapping: dict[str, str], sampling: dict[str, SamplingParams],
                       rng: random.Random) -> EpisodeResult | None:
            return await self._play(env, f"{gid}-{agent}", mapping, "eval", sampling, rng)

        return await evaluate_player(self.env_cls, env_cfg, agent, eval_roles(env_cfg, self.env_cls, agent),
                                     ev.opponent, ev.episodes, self.cfg.agents[agent].sampling, ev.temperature,
                                     play)

    async def evaluate_all(self, label: str) -> dict[str, float | None]:
        names = list(self.state.agents)
        reports = await asyncio.gather(*(self.evaluate(a) for a in names))
        out = {a: r["score"] for a, r in zip(names, reports, strict=True)}
        self.evals.append({"label": label, "time": time.time(), "scores": out,
                           "details": dict(zip(names, reports, strict=True)),
                           "versions": {a: self.state.agents[a].loaded_version for a in names}})
        log.info("eval %s: %s", label, {a: f"{r['score']} (w/d/l {r['wins']}/{r['draws']}/{r['losses']})"
                                        for a, r in zip(names, reports, strict=True)})
        return out

    def sampling_for(self, roles: dict[str, str]) -> dict[str, SamplingParams]:
        """Sampling per player; an in-process past version samples like the agent it came from."""
        out = {a: c.sampling for a, c in self.cfg.agents.items()}
        for player in roles.values():
            if player.startswith(POLICY):
                out[player] = self.cfg.agents[self._pool_owner(player)].sampling
        return out

    def _pool_owner(self, player: str) -> str:
        path = player[len(POLICY):]
        return next((a for a, vs in self.versions.items() if path in vs), next(iter(self.cfg.agents)))

    # --- the run ------------------------------------------------------------
    async def wait_for_engines(self, timeout: float = ENGINE_WAIT_S) -> None:  # noqa: ASYNC109 (gives up, logs)
        """No turn is sent before every agent's rollout reports a healthy engine (or the wait runs out)."""
        deadline = time.monotonic() + timeout
        async with self.changed:
            while not self.state.stop_requested and (missing := set(self.cfg.agents) - self.engines_ready):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("no healthy engine reported for %s after %.0fs; starting anyway", missing, timeout)
                    return
                log.info("waiting for the engines of %s", ", ".join(sorted(missing)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), min(left, 30.0))

    async def run(self) -> None:
        await self.wait_for_engines()
        self.state.phase = "eval_start"
        if self.cfg.environment.eval.episodes:
            for agent, score in (await self.evaluate_all("start")).items():
                self.state.agents[agent].eval_start = score
        await self.training_loop()
        if self.state.stop_requested:
            for task in self.group_tasks:
                task.cancel()
        if self.group_tasks:
            await asyncio.gather(*self.group_tasks, return_exceptions=True)
        if not self.state.stop_requested and self.cfg.environment.eval.episodes:
            self.state.phase = "eval_end"
            for agent, score in (await self.evaluate_all("end")).items():
                self.state.agents[agent].eval_end = score
        self.state.phase = "stopped" if self.state.stop_requested else "done"
