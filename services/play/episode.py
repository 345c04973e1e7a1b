"""Play one episode: render each player's view, ask the acting player, feed the reply back.

Each role played by a model keeps a token-exact view: user turns rendered with that player's
tokenizer and chat template (loss mask 0), and the generated ids exactly as the engine returned
them (loss mask 1, with their rollout logprobs), each generation recorded as a ``Turn`` (its span, weight
version, reply and what the role earned from it: ``Sample.turns`` and ``turn_rewards`` come from these
records). ``trains`` is the one rule of which views become samples. A role may be played by an
agent (its rollout's engines), by one of the environment's scripted players, or by fixed
weights run in-process (a ``Local`` player: opponent-pool versions, ``tandem eval``); ``generate``
routes each model player's request. Per-turn rewards, when an environment gives them, are added
to the final ones. A reply the environment marks as illegal or malformed (``StepResult.info`` holds
a key of ``FORMAT_FAILURE_KEYS``) is flagged ``invalid`` in the transcript: the illegal or
format-failure rate that evaluation and training report (docs/architecture.md §8) counts these.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.contracts.messages import GenerateReply, GenerateRequest, Sample, SamplingParams, TurnSpan
from services.contracts.players import AgentPlayer, Player, Pool, Scripted
from services.envs.base import Environment
from services.envs.render import ChatRenderer
from services.envs.tools.base import Limits, ToolBox

MAX_TURNS = 200
FORMAT_FAILURE_KEYS = ("illegal", "malformed")  # StepResult.info keys that mark a reply as a format failure

Generate = Callable[[Player, GenerateRequest], Awaitable[GenerateReply]]


@dataclass
class Turn:
    """One generation of a view: its tokens ``[start, end)`` (loss mask 1; ``start == end`` when it generated
    none), the reply that made them and what the role earned from it until its next generation."""

    start: int
    end: int
    weight_version: int
    reply_id: str
    engine: str
    turn: int = 0         # the episode's turn it belongs to (a turn with tool calls has one Turn per generation)
    reward: float = 0.0   # the environment's per-turn rewards to the role from this generation until its next

    @property
    def generated(self) -> bool:
        return self.end > self.start


@dataclass
class View:
    """One role's token-exact view: what a Sample is built from. ``turns`` records each generation (in order);
    ``reward_before`` the per-turn rewards the role got before its first generated token."""

    player: Player
    role: str
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward_before: float = 0.0

    @property
    def agent(self) -> str:
        """The player as the records name it (an agent's name for an agent)."""
        return str(self.player)

    @property
    def generated(self) -> list[Turn]:
        """The generations that produced tokens: a Sample's turns (one that produced none is no turn)."""
        return [t for t in self.turns if t.generated]

    @property
    def weight_versions(self) -> list[int]:
        """Per generation (a tokenless one too), the weight version that answered it."""
        return [t.weight_version for t in self.turns]

    def add_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)

    def add_reply(self, reply: GenerateReply, turn: int = 0) -> Turn:
        start = len(self.tokens)
        self.tokens += reply.output_ids
        self.loss_mask += [1] * len(reply.output_ids)
        self.rollout_logprobs += reply.output_logprobs
        self.turns.append(Turn(start, len(self.tokens), reply.weight_version, reply.id, reply.engine, turn))
        return self.turns[-1]

    def earn(self, reward: float) -> None:
        """A per-turn reward to this role: its last generated turn's (before any, ``reward_before``)."""
        generated = self.generated
        if generated:
            generated[-1].reward += reward
        else:
            self.reward_before += reward


def turn_credit(view: View, total: float) -> list[float]:
    """What each of the view's generated turns earned (``Sample.turn_rewards``): the per-turn rewards the role
    got from that turn until its next one (those before its first turn go to the first), the final reward (the
    rest of ``total``) to the last. A generation with no token is no turn: its rewards go to the one before; a
    turn with tool calls is one turn per generation (``View.earn`` keeps them on the records as play goes)."""
    credit = [t.reward for t in view.generated]
    if not credit:
        return []
    credit[0] += view.reward_before
    credit[-1] += total - sum(credit)
    return credit


def trains(view: View, agents: Collection[str]) -> bool:
    """Whether ``view`` becomes a Sample: played by one of ``agents`` (an ``AgentPlayer``: a frozen or
    in-process player is never trained on) and generated at least one token. The one rule the episode's
    samples and the group's counts (``group_samples``) both follow."""
    return isinstance(view.player, AgentPlayer) and view.player.agent in agents and bool(view.generated)


def group_samples(results: Iterable[EpisodeResult], agents: Collection[str]) -> dict[str, int]:
    """Per agent of ``agents``, its samples in a group played as ``results`` (``Sample.group_samples``)."""
    counts = dict.fromkeys(agents, 0)
    for result in results:
        for view in result.views.values():
            if trains(view, agents):
                counts[view.agent] += 1
    return counts


@dataclass
class EpisodeResult:
    episode_id: str
    group_id: str
    roles: dict[str, Player]
    rewards: dict[str, float]
    transcript: list[dict[str, Any]]
    views: dict[str, View]
    summary: dict[str, Any]
    purpose: str
    chats: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # per model role, its chat as messages

    def samples(self, group_samples: dict[str, int]) -> list[Sample]:
        """One Sample per view that ``trains`` for an agent of ``group_samples`` (agent -> its samples in the
        whole group, the ``Sample.group_samples`` the buffer completes the group at)."""
        out = []
        for role, view in self.views.items():
            if not trains(view, group_samples):
                continue
            agent, reward, turns = view.agent, self.rewards.get(role, 0.0), view.generated
            out.append(Sample(
                agent=agent, role=role, episode_id=self.episode_id, group_id=self.group_id,
                group_samples=group_samples[agent], tokens=view.tokens, loss_mask=view.loss_mask,
                rollout_logprobs=view.rollout_logprobs, reward=reward,
                turns=[TurnSpan(start=t.start, end=t.end) for t in turns],
                weight_versions=[t.weight_version for t in turns], engines=[t.engine for t in turns],
                reply_ids=[t.reply_id for t in turns], turn_rewards=turn_credit(view, reward),
                malformed_turns=self.replies(role)[1],
            ))
        return out

    def replies(self, role: str) -> tuple[int, int]:
        """(replies, illegal or malformed ones) of the model player in ``role`` (0, 0 for a scripted role)."""
        if role not in self.views:
            return 0, 0
        mine = [t for t in self.transcript if t.get("role") == role and "text" in t]
        return len(mine), sum(1 for t in mine if t.get("invalid"))

    def record(self) -> dict[str, Any]:
        return {"id": self.episode_id, "group_id": self.group_id, "purpose": self.purpose,
                "roles": {r: str(p) for r, p in self.roles.items()}, "rewards": self.rewards,
                "summary": self.summary, "turns": self.transcript}


@dataclass
class _Episode:
    """The loop's state: the env, its players and what they need to generate."""

    env: Environment
    episode_id: str
    group_id: str
    roles: Mapping[str, Player]
    sampling: Mapping[Player, SamplingParams]
    generate: Generate
    purpose: str
    max_context: Mapping[Player, int]
    views: dict[str, View] = field(default_factory=dict)
    renderers: dict[str, ChatRenderer] = field(default_factory=dict)
    toolboxes: dict[str, ToolBox] = field(default_factory=dict)

    async def model_turn(self, turn: int, role: str, entry: dict[str, Any]) -> str | None:
        """Render the observation, generate, record the reply; while the reply calls one of the role's tools
        (within its limits), run the call, append the result as a tool message (loss mask 0) and generate
        again. The turn's reply is the last generation's text; None when a prompt would not fit."""
        observation = self.env.observation(role)
        entry.update(observation=observation)
        box = self.toolboxes.get(role)
        reply = await self.generate_after(turn, role, self.renderers[role].user_turn(observation), entry)
        if reply is None:
            return None
        text = self.renderers[role].assistant_turn(reply.output_ids)
        if box is None:
            return text
        box.new_turn()
        calls: list[dict[str, Any]] = []
        entry.update(tool_calls=calls)
        while (call := box.parse(text, reply.finish_reason == "length")) is not None and box.can_call():
            outcome = (await box.run(call)).record()
            calls.append(outcome)
            self.env.tool_used(role, outcome)
            context = self.renderers[role].user_turn(outcome["result"], role="tool")
            reply = await self.generate_after(turn, role, context, entry, len(calls))
            if reply is None:
                return None
            text = self.renderers[role].assistant_turn(reply.output_ids)
        return text

    async def generate_after(self, turn: int, role: str, context: list[int], entry: dict[str, Any],
                             call: int = 0) -> GenerateReply | None:
        """Append ``context`` (mask 0) to the role's view and generate the next reply (mask 1); None, with the
        entry marked truncated, when the prompt would not fit the player's context."""
        player, view = self.roles[role], self.views[role]
        if len(view.tokens) + len(context) >= self.max_context.get(player, 1 << 62):
            entry.update(truncated=True)
            return None
        view.add_context(context)
        params = self.sampling[player]
        if params.seed is not None:  # a seeded episode: each turn (and each generation after a tool call) its own
            params = params.model_copy(update={"seed": params.seed + turn + 100_003 * call})
        request = GenerateRequest(
            agent=str(player), episode_id=self.episode_id, group_id=self.group_id, turn=turn, role=role,
            input_ids=list(view.tokens), sampling=params, reply_stream="", purpose=self.purpose)
        reply = await self.generate(player, request)
        view.add_reply(reply, turn)
        entry.update(weight_version=reply.weight_version, finish_reason=reply.finish_reason,
                     tokens=entry.get("tokens", 0) + len(reply.output_ids), generations=call + 1)
        return reply


def group_scripted_rng(group_seed: int) -> random.Random:
    """The scripted players' random stream every copy of a training group restarts under
    ``environment.scripted_rng: group`` (docs/architecture.md §4): derived from the group's seed, apart from
    the environment's own stream of that seed."""
    return random.Random(f"scripted-{group_seed}")


async def play_episode(
    env: Environment,
    episode_id: str,
    group_id: str,
    roles: Mapping[str, Player],
    tokenizers: Mapping[Player, Any],
    sampling: Mapping[Player, SamplingParams],
    generate: Generate,
    purpose: str = "train",
    rng: random.Random | None = None,
    max_context: Mapping[Player, int] | None = None,
) -> EpisodeResult:
    """``roles`` maps each env role to its player (a ``Pool`` player must be resolved to a ``Local``
    one first); ``tokenizers``, ``sampling`` and ``max_context`` are keyed by the model players.
    ``generate(player, request)`` answers a model player's turn. When a role's next prompt would not
    fit its player's context, the episode ends there as truncated: every role gets reward 0 (plus
    the per-turn rewards so far)."""
    if any(isinstance(p, Pool) for p in roles.values()):
        raise ValueError(f"episode {episode_id}: pool players must be drawn before play ({roles})")
    rng = rng or random.Random(episode_id)
    ep = _Episode(env, episode_id, group_id, roles, sampling, generate, purpose, max_context or {})
    for r, p in roles.items():
        if not isinstance(p, Scripted):
            ep.views[r] = View(player=p, role=r)
            system = env.system_prompt(r)
            if env.tool_names(r):
                box = ep.toolboxes[r] = ToolBox(env.tool_names(r), tool_limits(env))
                system = f"{system}\n\n{box.describe()}" if system else box.describe()
            ep.renderers[r] = ChatRenderer(tokenizers[p], system)
    try:
        return await _play(ep, rng)
    finally:
        for box in ep.toolboxes.values():
            box.close()


async def _play(ep: _Episode, rng: random.Random) -> EpisodeResult:
    """The turn loop of ``play_episode``."""
    env, roles, episode_id = ep.env, ep.roles, ep.episode_id
    transcript: list[dict[str, Any]] = []
    rewards: dict[str, float] = {}
    turn_rewards: dict[str, float] = {}
    truncated = False
    for turn in range(MAX_TURNS):
        role = env.current_role()
        player = roles[role]
        entry: dict[str, Any] = {"turn": turn, "role": role, "agent": str(player)}
        if isinstance(player, Scripted):
            text: str | None = env.scripted_reply(role, player.name, rng)
        else:
            text = await ep.model_turn(turn, role, entry)
        if text is None:
            truncated = True
            transcript.append(entry)
            break
        result = await env.step(role, text)
        for r, v in result.turn_rewards.items():
            turn_rewards[r] = turn_rewards.get(r, 0.0) + v
            if r in ep.views:
                ep.views[r].earn(float(v))
        entry.update(text=text, turn_rewards=result.turn_rewards)
        failure = format_failure(result.info)
        if failure is not None:
            entry["invalid"] = failure
        transcript.append(entry)
        if result.done:
            rewards = dict(result.rewards)
            break
    rewards = final_rewards(env, episode_id, roles, rewards, turn_rewards)
    summary = {**env.summary(), **({"truncated": True} if truncated else {})}
    chats = {r: renderer.conversation() for r, renderer in ep.renderers.items()}
    return EpisodeResult(episode_id, ep.group_id, dict(roles), rewards, transcript, ep.views, summary, ep.purpose,
                         chats)


def tool_limits(env: Environment) -> Limits:
    """The environment's tool limits: its ``ToolParams``' when it has them, else the defaults."""
    limits = getattr(env.params, "limits", None)
    return limits() if callable(limits) else Limits()


def format_failure(info: Mapping[str, Any]) -> str | None:
    """Why a step's reply was illegal or malformed (its ``info``'s ``FORMAT_FAILURE_KEYS``), or None."""
    for key in FORMAT_FAILURE_KEYS:
        value = info.get(key)
        if value is not None and value is not False:  # present: its text may be empty (an empty reply)
            return f"{key}: {value if value != '' else '(empty reply)'}"[:80]
    return None


def final_rewards(env: Environment, episode_id: str, roles: Mapping[str, Player], rewards: dict[str, float],
                  turn_rewards: dict[str, float]) -> dict[str, float]:
    """The final rewards (0 for all when out of turns or context) plus the per-turn ones; raises on NaN/inf."""
    rewards = dict(rewards) if rewards else {r: 0.0 for r in roles}
    for r, v in turn_rewards.items():
        rewards[r] = rewards.get(r, 0.0) + v
    bad = {r: v for r, v in rewards.items() if not math.isfinite(v)}
    if bad:  # a NaN would poison the group's advantages and the weights: abandon this episode instead
        raise ValueError(f"environment {type(env).__name__} gave non-finite rewards {bad} (episode {episode_id})")
    return rewards
