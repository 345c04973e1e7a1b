"""The coordinator service: evaluation, gated group launches, sample emission, the end.

One handler per stream: ``on_reply`` (replies), ``on_event`` (events: notifications, whose facts are read
from their owners, facts.py), ``on_control`` (control). Main loop (``Coordinator.run``): evaluate every
agent against the env's scripted opponents (evals.py); launch GRPO groups while the staleness gate allows
(state.py) and the run is not paused, evaluating every ``eval.every_n_steps`` beside them; when every
agent has loaded its last version, evaluate again, write the report and tell all services to stop.
A group playing past ``run.group_timeout_s`` or 4 x the slowest recent one is abandoned. Restartable:
``restore`` rebuilds the run state from Redis (record.py, ledger.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

from services.common.bus import Bus
from services.common.latency import LatencyWindow
from services.common.reconnect import REDIS_DOWN
from services.common.tokens import context_length, load_tokenizer
from services.contracts.config import TandemConfig
from services.contracts.messages import Control, Event, GenerateReply, GenerateRequest, SamplingParams, new_id
from services.contracts.players import AgentPlayer, Local, Player, Pool, Scripted
from services.contracts.records import GroupState
from services.coordinator import evals, failures, learning_signal, play_archive, train_play
from services.coordinator.archive import TranscriptArchive, store_episode
from services.coordinator.facts import OwnerFacts
from services.coordinator.ledger import GroupLedger, horizons
from services.coordinator.record import RunRecord, restore_run
from services.coordinator.replies import ReplyCheck
from services.coordinator.report import write_report
from services.coordinator.state import RunState, finite, train_step_entry
from services.envs.registry import check_environment_config
from services.play.episode import EpisodeResult, group_scripted_rng, play_episode
from services.play.local import LocalPlayers  # torch is imported when a Local player first plays

log = logging.getLogger("tandem.coordinator")

TURN_TIMEOUT_S, ENGINE_WAIT_S = 300.0, 1800.0  # SGLang engines can take minutes to load a real model
MAX_EMPTY_GROUPS, EPISODE_CACHE = 50, 2000


class Coordinator:
    def __init__(self, cfg: TandemConfig, bus: Bus, name: str = "coordinator") -> None:
        self.cfg, self.bus, self.name = cfg, bus, name
        self.state = RunState.from_config(cfg)
        self.env_cls = check_environment_config(cfg.environment)
        self.tokenizers: dict[str, Any] = {a: load_tokenizer(c.model_path) for a, c in cfg.agents.items()}
        self.local = LocalPlayers()
        self.context: dict[str, int] = {a: context_length(c.model_path) for a, c in cfg.agents.items()}
        # opponent pool: each agent's weight versions as they load (version 0 is the start model)
        self.pool_paths: dict[str, list[str]] = {a: [c.model_path] for a, c in cfg.agents.items()}
        self.version_paths: dict[str, dict[int, str]] = {a: {0: c.model_path} for a, c in cfg.agents.items()}
        self.pool_rng = random.Random(cfg.run.seed)
        self.reply_stream = bus.streams.replies(name)
        self.group_seconds = LatencyWindow(size=32)  # how long groups took to play: the group timeout follows it
        self.pending: dict[str, asyncio.Future[GenerateReply]] = {}
        self.changed = asyncio.Condition()
        self.slots = asyncio.Semaphore(cfg.run.concurrent_episodes)
        self.episodes: dict[str, dict[str, Any]] = {}  # recent transcripts (the API's cache)
        self.evals: list[dict[str, Any]] = []  # evaluation reports in order
        self.group_tasks: set[asyncio.Task[None]] = set()
        self.eval_task: asyncio.Task[dict[str, float]] | None = None
        self.empty_streak: dict[str, int] = {}
        self.signal = learning_signal.SignalWatch(cfg)  # steps without learning signal
        self.engines_ready: set[str] = set()  # agents whose rollout reports a healthy engine
        self.ledger = GroupLedger(bus, list(self.state.agents), cfg.run_dir(), horizons(cfg))
        self.run_record = RunRecord(bus, cfg.run.checkpoint_root)
        self.archive = TranscriptArchive(bus, cfg.run.transcripts_kept, cfg.run_dir())
        self.evals_saved = 0  # evaluation reports already in the run record
        self.k_train_play, self.k_failed = bus.streams.key("coord:train_play"), bus.streams.key("coord:episodes_failed")
        self.replies = ReplyCheck(cfg, bus)  # engine replies checked before they enter an episode (replies.py)
        self.facts = OwnerFacts(bus, cfg.run.checkpoint_root)  # what events announce, read from the owners

    async def restore(self) -> None:
        """Rebuild the run state from Redis (record.py): a first start finds it empty, a restart the run."""
        self.evals, paths = await restore_run(self.state, self.run_record, self.ledger)
        self.evals_saved = len(self.evals)
        for agent, loaded in paths.items():
            self.pool_paths[agent] += [p for p in loaded if p not in self.pool_paths[agent]]
            versions = await self.run_record.versions(agent)
            self.version_paths[agent].update({r.weight_version: r.path for r in versions.loaded_records})
        for agent, counts in (await play_archive.load(self.bus.redis, self.k_train_play, self.cfg.run_dir())).items():
            if agent in self.state.agents:
                self.state.agents[agent].train_play = counts
        self.state.episodes_failed = await failures.load(self.bus.redis, self.k_failed)

    # --- plumbing -----------------------------------------------------------
    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def generate(self, player: Player, req: GenerateRequest) -> GenerateReply:
        if isinstance(player, Local):
            return await self.local.generate(player, req)
        req = req.model_copy(update={"reply_stream": self.reply_stream})
        fut: asyncio.Future[GenerateReply] = asyncio.get_running_loop().create_future()
        self.pending[req.id] = fut
        try:
            await self.bus.publish(self.bus.streams.turns(req.agent), req)
            return await asyncio.wait_for(fut, TURN_TIMEOUT_S)
        finally:
            self.pending.pop(req.id, None)

    async def on_reply(self, reply: GenerateReply) -> None:
        fut = self.pending.get(reply.request_id)
        if (problem := self.replies.problem(reply)) is not None:  # rejected alone, its episode abandoned
            await self.replies.reject(reply, fut, problem)  # raises Reject: dead-lettered with the reason
        if fut is not None and not fut.done():
            if reply.error:
                fut.set_exception(RuntimeError(f"generation failed: {reply.error}"))
            else:
                fut.set_result(reply)

    async def on_event(self, ev: Event) -> None:
        """Events notify; versions and step metrics come from their owners' records (facts.py: else Reject)."""
        fact = await self.facts.weights_loaded(ev) if ev.kind == "weights_loaded" else None
        if fact is not None and fact.path is not None and ev.agent in self.pool_paths:
            self.version_paths[ev.agent][fact.version] = fact.path
            self.pool_paths[ev.agent] += [] if fact.path in self.pool_paths[ev.agent] else [fact.path]
        if ev.kind == "rollout_load" and ev.agent not in self.engines_ready and any(
                e.healthy for e in ev.engines):
            self.engines_ready.add(ev.agent)  # frozen agents too: they have no AgentState
            await self.notify()
        agent = self.state.agents.get(ev.agent)
        if agent is None:
            return
        if fact is not None:
            agent.loaded_weight_version = max(agent.loaded_weight_version, fact.version)
            if fact.version not in agent.loaded_weight_versions:
                agent.loaded_weight_versions.append(fact.version)
        elif ev.kind == "train_step" and all(t.get("weight_version") != ev.weight_version for t in agent.train_steps):
            entry = train_step_entry(await self.facts.train_step(ev))  # the committed record's metrics
            agent.train_steps.append({**finite(entry), "time": ev.created_at})  # once per version (re-sends)
            self.signal.check(self.state, ev.agent)  # no learning signal: warn, stop at the limit
        elif ev.kind == "train_step_skipped" and not agent.all_dropped(ev.group_ids):
            await self.facts.skipped(ev)  # the trainer's record of the skip, else Reject
            agent.skip_step(ev.group_ids, ev.reason)  # once per batch (re-sends find its groups dropped)
        elif ev.kind == "rollout_load":
            agent.rollout = ev.report()
        elif ev.kind == "group_done":
            agent.resolve_group(ev.group_id, ev.outcome, ev.reason or "")
        await self.notify()

    async def on_control(self, cmd: Control) -> None:
        """A ``stop`` from elsewhere ends the run gracefully; the coordinator's own final one changes nothing."""
        if cmd.command == "stop" and self.state.phase not in ("done", "stopped"):
            await self.control("stop")

    async def control(self, command: str) -> None:
        """pause / resume / stop the run, recorded in Redis (a restart keeps it). ``stop`` ends it gracefully: no
        new groups, the report is written, and only then are the other services told to stop."""
        if command == "pause":
            self.state.paused = True
        elif command == "resume":
            self.state.paused = False
        elif command == "stop":
            self.state.stop_requested = True
        await self.run_record.set(paused=self.state.paused, stop_requested=self.state.stop_requested)
        await self.notify()

    async def record(self, result: EpisodeResult) -> None:
        rec = result.record()
        self.episodes[result.episode_id] = rec
        if len(self.episodes) > EPISODE_CACHE:
            self.episodes.pop(next(iter(self.episodes)))
        await store_episode(self.bus, self.archive, self.run_record, result, rec)  # retried through a restart
        self.state.episodes_done += 1
        self.state.episode_times.append(time.time())
        if result.purpose == "train":  # the agents' illegal / format-failure rate, per version (train_play.py)
            await train_play.count(self.bus, self.k_train_play, self.state.agents, result)

    async def _play(self, env: Any, group_id: str, roles: dict[str, Player], purpose: str,
                    sampling: dict[Player, SamplingParams], rng: random.Random | None = None) -> EpisodeResult | None:
        async with self.slots:
            try:
                tokenizers: dict[Player, Any] = {}
                context: dict[Player, int] = {}
                for p in set(roles.values()):
                    if isinstance(p, AgentPlayer):
                        tokenizers[p], context[p] = self.tokenizers[p.agent], self.context[p.agent]
                    elif isinstance(p, Local):  # a pool version seen for the first time: read it off the loop
                        tokenizers[p] = await asyncio.to_thread(self.local.tokenizer, p.path)
                        context[p] = await asyncio.to_thread(self.local.context_length, p.path)
                result = await play_episode(env, new_id(), group_id, roles, tokenizers, sampling,
                                            self.generate, purpose, rng, context)
            except Exception as exc:  # an env bug or a lost turn abandons one episode, not the run (failures.py)
                log.warning("episode of group %s abandoned: %r", group_id, exc)
                await failures.record(self.bus, self.k_failed, self.state.episodes_failed, purpose, roles)
                return None
        await self.record(result)
        return result

    def tokenizer_for(self, player: Player) -> Any:
        """The tokenizer a player's tokens are in (blocking: call it off the loop), or None (scripted)."""
        if isinstance(player, Local):
            return self.local.tokenizer(player.path)
        return None if isinstance(player, Scripted) else self.tokenizers.get(player.agent)

    # --- training groups ----------------------------------------------------
    def roles_for_group(self, index: int) -> dict[str, Player]:
        """Group ``index``'s players: matchups cycled (or roles), the same after a restart (``group_roles``)."""
        return self.cfg.environment.group_roles(index)

    def passes_over(self, roles: dict[str, Player]) -> bool:
        """A matchup whose agents want no group is passed over while another agent wants some (not stalled)."""
        if any(self.state.agents[a].wants_groups() for a in self.trained(roles)):
            return False
        return any(a.wants_groups() for a in self.state.agents.values())

    def resolve_pool(self, roles: dict[str, Player]) -> dict[str, Player]:
        """A ``Pool`` player becomes one of its agent's last ``pool_size`` versions, drawn per group."""
        out: dict[str, Player] = {}
        for role, player in roles.items():
            if isinstance(player, Pool):
                recent = self.pool_paths[player.agent][-self.cfg.environment.pool_size:]
                player = Local(path=self.pool_rng.choice(recent), agent=player.agent)
            out[role] = player
        return out

    def trained(self, roles: dict[str, Player]) -> set[str]:
        """The agents that train on a group played with ``roles``."""
        return {p.agent for p in roles.values() if isinstance(p, AgentPlayer) and p.agent in self.state.agents}

    def may_launch(self, roles: dict[str, Player], index: int) -> bool:
        wanting = [self.state.agents[a] for a in sorted(self.trained(roles)) if self.state.agents[a].wants_groups()]
        return bool(wanting) and not self.state.closed_gates(index, wanting)  # noted for /v1/status

    async def play_group(self, index: int, roles: dict[str, Player], group_id: str) -> list[EpisodeResult]:
        seed, shared = self.cfg.run.seed * 1_000_003 + index, self.cfg.environment.scripted_rng == "group"
        envs = self.env_cls.make_group(self.cfg.environment.params, seed, self.cfg.environment.group_size)
        sampling = self.sampling_for(roles)
        results = await asyncio.gather(*(self._play(e, group_id, roles, "train", sampling,
                                                    group_scripted_rng(seed) if shared else None) for e in envs))
        return [r for r in results if r is not None]

    async def run_group(self, index: int, roles: dict[str, Player], group_id: str) -> None:
        """Play one group and emit its samples; each agent's part ends in the ledger: emitted, or abandoned."""
        agents = self.trained(roles)
        roles = self.resolve_pool(roles)
        emitted: set[str] = set()
        timeout, started = self.group_seconds.bound(self.cfg.run.group_timeout_s), time.monotonic()
        try:
            done = await asyncio.wait_for(self.play_group(index, roles, group_id), timeout)
            self.group_seconds.add(time.monotonic() - started)
            group_samples = {a: sum(1 for r in done for v in r.views.values() if v.agent == a and any(v.loss_mask))
                             for a in agents}
            samples = [sample for r in done for sample in r.samples(group_samples)]
            empty = {a: "episode error: every episode of the group failed" if not done else "no turn in any episode"
                     for a in agents if not group_samples[a]}
            means = await self.ledger.emit(group_id, samples, empty)
            emitted = set(means)
            for agent, mean in means.items():
                self.state.agents[agent].group_rewards.append((time.time(), mean))
            for agent, reason in empty.items():
                self.state.agents[agent].resolve_group(group_id, GroupState.ABANDONED, reason)
        except TimeoutError:
            await self.abandon(group_id, agents, f"timeout: still playing after {timeout:g}s")
        except asyncio.CancelledError:
            await self.abandon(group_id, agents, "run stopped")
            raise
        except Exception as exc:
            log.exception("group %s failed", group_id)
            await self.abandon(group_id, agents, f"episode error: {exc!r}")
        finally:
            self.check_starved(agents, emitted)
            await self.notify()

    async def abandon(self, group_id: str, agents: set[str], reason: str) -> None:
        log.warning("group %s abandoned: %s", group_id, reason)
        try:
            await self.ledger.abandon(group_id, agents, reason)
        except Exception:  # Redis unreachable: the ledger keeps the group playing, which a restart abandons
            log.exception("cannot record group %s as abandoned", group_id)
        for agent in agents:
            self.state.agents[agent].resolve_group(group_id, GroupState.ABANDONED, reason)

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
                    not self.state.paused and (self.may_launch(r, self.state.groups_launched) or self.passes_over(r))))
            if self.state.stop_requested or self.all_finished():
                break
            if self.passes_over(roles):
                self.state.groups_launched += 1  # no ledger entry: nobody trains on it; a restart passes it again
                self.state.gate_wait = None
                continue
            index, agents = self.state.groups_launched, self.trained(roles)
            group_id = f"g{index:06d}-{new_id()[:8]}"
            await self.ledger.launch(group_id, index, agents)
            for agent in agents:
                self.state.agents[agent].in_flight_groups += 1
            task = asyncio.create_task(self.run_group(index, roles, group_id))
            self.group_tasks.add(task)
            task.add_done_callback(self.group_tasks.discard)
            self.state.launched(index)  # groups_launched += 1

    def all_finished(self) -> bool:
        return all(a.finished for a in self.state.agents.values())

    async def evaluate_all(self, label: str) -> dict[str, float | None]:
        """Every training agent against every eval opponent, on its engines now (evals.py)."""
        return await evals.evaluate_all(self, label)

    def sampling_for(self, roles: dict[str, Player]) -> dict[Player, SamplingParams]:
        """Sampling per model player; an in-process past version samples like the agent it came from."""
        return {p: self.cfg.agents[p.agent].sampling for p in roles.values() if not isinstance(p, Scripted | Pool)}

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
        """The run from where the run record stands: evaluations already done are not repeated."""
        await self.wait_for_engines()
        done = {e["label"] for e in self.evals}
        if self.cfg.environment.eval.episodes and "start" not in done:
            await evals.at_edge(self, "start")
        periodic = asyncio.create_task(evals.every_n_steps(self))
        await self.training_loop()
        if self.state.stop_requested:
            for task in self.group_tasks:
                task.cancel()
        if self.group_tasks:
            await asyncio.gather(*self.group_tasks, return_exceptions=True)
        if self.state.stop_requested:
            periodic.cancel()
        await asyncio.gather(periodic, return_exceptions=True)  # the last every-n evaluation, then the end one
        await self.run_record.set(stop_requested=self.state.stop_requested, error=self.state.error)
        if not self.state.stop_requested and self.cfg.environment.eval.episodes and "end" not in done:
            await evals.at_edge(self, "end")
        self.state.phase = "stopped" if self.state.stop_requested else "done"

    async def save_evals(self) -> None:
        await self.run_record.add_evals(self.evals[self.evals_saved:])
        self.evals_saved = len(self.evals)  # after the write: a failed one is tried again

    async def run_and_report(self, server: Any | None = None, run_logger: Any | None = None) -> None:
        """Run, write the report, close the experiment logs (after the report: they hold at least what it
        holds), then tell every service to stop (and the API server to exit)."""
        await self.run()
        await self.save_evals()
        wall = time.time() - self.state.started_at
        path = await asyncio.to_thread(write_report, self.state, self.evals, self.cfg.run_dir(), wall)
        log.info("report written to %s", path)
        if run_logger is not None:
            await run_logger.close(self)
        await self.bus.publish(self.bus.streams.control, Control(command="stop", args={"reason": self.state.phase}))
        if server is not None:
            server.should_exit = True

    async def housekeeping(self, stop: asyncio.Event) -> None:
        """Every ``run.trim_interval_s`` (0: never): save new evaluation reports (on-demand ones), and
        trim what every consumer group has acknowledged."""
        s, cfg = self.bus.streams, self.cfg
        streams = [s.events, s.control, s.replies(self.name)] + [
            f(a) for a in cfg.agents for f in (s.turns, s.samples, s.batches, s.weights)]
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.run.trim_interval_s or 30.0)
            try:  # a Redis outage (or full disk) skips a round: the next one does it (common/reconnect.py)
                await self.save_evals()
                for name in streams if cfg.run.trim_interval_s else []:
                    await self.bus.trim_acknowledged(name)
                for agent in self.ledger.agents:  # resolved groups past the staleness horizon (ledger.py prune)
                    await self.ledger.prune(agent)
                await play_archive.prune_behind(self.bus.redis, s, self.k_train_play, cfg.run_dir(),
                                                self.ledger.horizons)
            except REDIS_DOWN as exc:
                log.warning("housekeeping skipped this round: %s", exc)
