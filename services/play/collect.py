"""``tandem collect CONFIG --checkpoint [AGENT=]DIR --episodes N --out FILE [--min-reward R]``: trajectories for
supervised training.

Plays ``N`` training episodes of the config's environment (its roles: agents as in-process ``Local`` players
with the given weights or their ``model_path``, scripted players as they are) and writes, for every model
role of every episode whose reward is at least ``--min-reward``, one JSON line in chat format:
``messages`` (system, user, assistant and tool messages, as the agent's chat template rendered them),
``reward``, ``measures`` (the environment's summary measures of that episode), ``weight_version`` (the
checkpoint directory's ``vNNNNN`` version, 0 for a ``model_path``), ``agent``, ``role``, ``environment``,
``episode_id`` and ``demonstration`` (true for a role played with ``--demonstrate ROLE``: the environment's
demonstrations, services/play/demonstrate.py, in that agent's chat template, instead of its model).
The Tinker cookbook's ``FromConversationFileBuilder`` and TRL's SFT trainer read it as is (they use ``messages``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from services.contracts.config import ConfigError, TandemConfig, load_config
from services.contracts.messages import GenerateReply, GenerateRequest
from services.contracts.players import AgentPlayer, Local, Player, Scripted
from services.envs.registry import check_environment_config
from services.play.demonstrate import Demonstrator, check_demonstrated
from services.play.episode import EpisodeResult, play_episode
from services.play.evaluation import summary_means
from services.play.local import LocalPlayers
from services.play.offline_eval import assign_checkpoints

VERSION = re.compile(r"^v(\d+)$")
CONCURRENT = 8


def weight_version(path: str) -> int:
    """A trainer checkpoint directory's version (``.../v00004`` is 4); 0 for any other model directory."""
    m = VERSION.match(Path(path).name)
    return int(m.group(1)) if m else 0


def seat_players(cfg: TandemConfig, checkpoints: dict[str, str]) -> dict[str, Player]:
    """role -> player: the config's agents as Local players on their weights, scripted players as they are."""
    out: dict[str, Player] = {}
    for role, player in cfg.environment.roles.items():
        if isinstance(player, AgentPlayer):
            path = checkpoints.get(player.agent, cfg.agents[player.agent].model_path)
            out[role] = Local(path=path, agent=player.agent)
        elif isinstance(player, Scripted):
            out[role] = player
        else:
            raise ConfigError(f"environment.roles.{role}: collect plays agents and scripted players, not {player}")
    return out


def records(result: EpisodeResult, env_name: str, measures: tuple[str, ...] | None,
            demonstrated: Collection[str] = ()) -> list[dict[str, Any]]:
    """One chat-format record per model role of the episode that replied (a role whose episode ended before its
    first turn has nothing to learn from: no record)."""
    out = []
    for role, messages in result.chats.items():
        if not any(m.get("role") == "assistant" for m in messages):
            continue
        player = result.roles[role]
        assert isinstance(player, Local)
        out.append({"messages": messages, "reward": result.rewards.get(role, 0.0),
                    "measures": summary_means([result.summary], measures), "weight_version": weight_version(
                        player.path), "agent": player.agent, "role": role, "environment": env_name,
                    "episode_id": result.episode_id, "demonstration": role in demonstrated})
    return out


async def collect(cfg: TandemConfig, checkpoints: dict[str, str], episodes: int, out: Path,
                  min_reward: float | None = None, demonstrate: Collection[str] = ()) -> dict[str, int]:
    """Play and write; returns how many records were kept, how many were dropped by ``min_reward``, and how many
    model roles were ``silent`` (their episode ended before their first turn: no record). The ``demonstrate``
    roles are played by the environment's demonstrations instead of their model."""
    env_cls = check_environment_config(cfg.environment)
    roles = seat_players(cfg, checkpoints)
    check_demonstrated(env_cls, {r for r, p in roles.items() if isinstance(p, Local)}, list(demonstrate))
    local = LocalPlayers()
    models = {p for p in roles.values() if isinstance(p, Local)}
    tokenizers = {p: await asyncio.to_thread(local.tokenizer, p.path) for p in models}
    context = {p: await asyncio.to_thread(local.context_length, p.path) for p in models}
    sampling = {p: cfg.agents[p.agent].sampling for p in models}
    demo = Demonstrator(tokenizers)

    async def generate(player: Player, request: GenerateRequest) -> GenerateReply:
        if request.role in demonstrate:
            return await demo.generate(player, request)
        return await local.generate(player, request)

    rng = random.Random(cfg.run.seed)
    seeds = [rng.randrange(1 << 31) for _ in range(episodes)]
    kept = dropped = silent = 0
    await asyncio.to_thread(_start, out)
    try:
        for start in range(0, episodes, CONCURRENT):
            envs = {f"collect-{start + i}": env_cls(cfg.environment.env_params(), seed)
                    for i, seed in enumerate(seeds[start:start + CONCURRENT])}
            for episode_id, env in envs.items():
                demo.show(episode_id, env)
            batch = await asyncio.gather(*(play_episode(
                env, episode_id, episode_id, roles, tokenizers, sampling, generate, "train",
                random.Random(seed), context) for (episode_id, env), seed in zip(
                    envs.items(), seeds[start:start + CONCURRENT], strict=True)))
            for episode_id in envs:
                demo.forget(episode_id)
            lines = []
            for result in batch:
                recs = records(result, cfg.environment.name, env_cls.summary_measures, demonstrate)
                silent += sum(isinstance(p, Local) for p in result.roles.values()) - len(recs)
                for rec in recs:
                    if min_reward is not None and rec["reward"] < min_reward:
                        dropped += 1
                    else:
                        lines.append(json.dumps(rec) + "\n")
            kept += len(lines)
            await asyncio.to_thread(_append, out, lines)
    finally:
        local.close()
    return {"kept": kept, "dropped": dropped, "silent": silent}


def _start(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")


def _append(path: Path, lines: list[str]) -> None:
    with open(path, "a") as fh:
        fh.writelines(lines)


def add_collect_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("config", help="the run config (YAML) whose environment, roles and agents are played")
    p.add_argument("--checkpoint", action="append", default=[], metavar="[AGENT=]DIR",
                   help="weights for an agent: an HF model directory or a LoRA run's adapter directory (repeatable); "
                        "without AGENT= they go to the training agents in order")
    p.add_argument("--episodes", type=int, required=True, help="episodes to play")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--min-reward", type=float, default=None, help="keep only trajectories with at least this reward")
    p.add_argument("--demonstrate", action="append", default=[], metavar="ROLE",
                   help="play ROLE with the environment's demonstrations, not its model (repeatable): warm-up data "
                        "for a protocol the model does not yet follow, e.g. tool calls")
    return p


def main(argv: list[str] | None = None) -> None:
    args = add_collect_arguments(argparse.ArgumentParser(prog="tandem collect", description=__doc__.split("\n")[0])
                                 ).parse_args(argv)
    try:
        if args.episodes < 1:
            raise ConfigError(f"--episodes {args.episodes}: must be at least 1")
        cfg = load_config(args.config)
        checkpoints = assign_checkpoints(cfg, args.checkpoint)
        counts = asyncio.run(collect(cfg, checkpoints, args.episodes, Path(args.out), args.min_reward,
                                     args.demonstrate))
    except (ConfigError, ValueError) as exc:
        print(f"tandem collect: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{args.out}: {counts['kept']} trajectories written, {counts['dropped']} below --min-reward, "
          f"{counts['silent']} roles with no turn (their episode ended first)")


if __name__ == "__main__":
    main()
