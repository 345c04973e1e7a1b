"""Play one episode: render each agent's view, ask the acting agent, feed the reply back.

Each role played by a model keeps a token-exact view: user turns rendered with
that agent's tokenizer and chat template (loss mask 0), and the generated ids
exactly as the engine returned them (loss mask 1, with their rollout logprobs
and weight version). A role may also be played by a scripted player, or by fixed weights run
in-process (``policy:<dir>``: past versions of an opponent pool, ``tandem eval``).
Per-turn rewards, when an environment gives them, are added to the final ones.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.contracts.messages import GenerateReply, GenerateRequest, Sample, SamplingParams
from services.envs.base import Environment
from services.envs.render import ChatRenderer

MAX_TURNS = 200
SCRIPTED = "scripted:"  # a role mapped to "scripted:random" is played without a model
POLICY = "policy:"  # a role mapped to "policy:<dir>" is played by those weights in-process

Generate = Callable[[GenerateRequest], Awaitable[GenerateReply]]


@dataclass
class View:
    agent: str
    role: str
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    reply_ids: list[str] = field(default_factory=list)

    def add_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_reply(self, reply: GenerateReply) -> None:
        self.tokens += reply.output_ids
        self.mask += [1] * len(reply.output_ids)
        self.logprobs += reply.output_logprobs
        self.versions.append(reply.weight_version)
        self.engines.append(reply.engine)
        self.reply_ids.append(reply.id)


@dataclass
class EpisodeResult:
    episode_id: str
    group_id: str
    roles: dict[str, str]
    rewards: dict[str, float]
    transcript: list[dict[str, Any]]
    views: dict[str, View]
    summary: dict[str, Any]
    purpose: str

    def samples(self, group_size: dict[str, int]) -> list[Sample]:
        out = []
        for role, view in self.views.items():
            if view.agent not in group_size or not any(view.mask):
                continue  # a frozen or in-process player: not trained
            out.append(Sample(
                agent=view.agent, role=role, episode_id=self.episode_id, group_id=self.group_id,
                group_size=group_size[view.agent], tokens=view.tokens, loss_mask=view.mask,
                rollout_logprobs=view.logprobs, reward=self.rewards.get(role, 0.0),
                turn_weight_versions=view.versions, engines=view.engines, reply_ids=view.reply_ids,
            ))
        return out

    def record(self) -> dict[str, Any]:
        return {"id": self.episode_id, "group_id": self.group_id, "purpose": self.purpose,
                "roles": self.roles, "rewards": self.rewards, "summary": self.summary,
                "turns": self.transcript}


async def play_episode(
    env: Environment,
    episode_id: str,
    group_id: str,
    roles: dict[str, str],
    tokenizers: Mapping[str, Any],
    sampling: Mapping[str, SamplingParams],
    generate: Generate,
    reply_stream: str,
    purpose: str = "train",
    rng: random.Random | None = None,
    max_context: Mapping[str, int] | None = None,
) -> EpisodeResult:
    """``roles`` maps each env role to a player: an agent name, ``scripted:<player>``, or
    ``policy:<dir>`` (weights played in-process; ``generate`` routes it by ``request.agent``).
    ``tokenizers`` and ``sampling`` are keyed by those player names. When a role's next prompt
    would not fit its player's context (``max_context``), the episode ends there as truncated:
    every role gets reward 0 (plus the per-turn rewards so far)."""
    rng = rng or random.Random(episode_id)
    views = {r: View(agent=a, role=r) for r, a in roles.items() if not a.startswith(SCRIPTED)}
    renderers = {r: ChatRenderer(tokenizers[a], env.system_prompt(r)) for r, a in roles.items()
                 if not a.startswith(SCRIPTED)}
    transcript: list[dict[str, Any]] = []
    rewards: dict[str, float] = {}
    turn_rewards: dict[str, float] = {}
    truncated = False
    for turn in range(MAX_TURNS):
        role = env.current_role()
        agent = roles[role]
        entry: dict[str, Any] = {"turn": turn, "role": role, "agent": agent}
        if agent.startswith(SCRIPTED):
            text = env.scripted_reply(role, agent[len(SCRIPTED):], rng)
        else:
            view, renderer = views[role], renderers[role]
            observation = env.observation(role)
            context = renderer.user_turn(observation)
            if max_context and len(view.tokens) + len(context) >= max_context.get(agent, 1 << 62):
                truncated = True
                entry.update(observation=observation, truncated=True)
                transcript.append(entry)
                break
            view.add_context(context)
            params = sampling[agent]
            if params.seed is not None:  # a seeded episode: each turn draws from its own seed
                params = params.model_copy(update={"seed": params.seed + turn})
            request = GenerateRequest(
                agent=agent, episode_id=episode_id, group_id=group_id, turn=turn, role=role,
                input_ids=list(view.tokens), sampling=params, reply_stream=reply_stream,
                purpose=purpose)
            reply = await generate(request)
            view.add_reply(reply)
            text = renderer.assistant_turn(reply.output_ids)
            entry.update(observation=observation, weight_version=reply.weight_version,
                         finish_reason=reply.finish_reason, tokens=len(reply.output_ids))
        result = await env.step(role, text)
        for r, v in result.turn_rewards.items():
            turn_rewards[r] = turn_rewards.get(r, 0.0) + v
        entry.update(text=text, turn_rewards=result.turn_rewards)
        transcript.append(entry)
        if result.done:
            rewards = dict(result.rewards)
            break
    if not rewards:  # out of turns or out of context
        rewards = {r: 0.0 for r in roles}
    for r, v in turn_rewards.items():  # per-turn rewards add to the final one
        rewards[r] = rewards.get(r, 0.0) + v
    bad = {r: v for r, v in rewards.items() if not math.isfinite(v)}
    if bad:  # a NaN would poison the group's advantages and the weights: abandon this episode instead
        raise ValueError(f"environment {type(env).__name__} gave non-finite rewards {bad} (episode {episode_id})")
    summary = {**env.summary(), **({"truncated": True} if truncated else {})}
    return EpisodeResult(episode_id, group_id, roles, rewards, transcript, views, summary, purpose)
