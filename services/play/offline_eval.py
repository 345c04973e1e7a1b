"""``tandem eval CONFIG [--checkpoint [AGENT=]DIR ...]``: score weights without starting a run.

Plays the config's held-out evaluation (evaluation.py: seeded episodes, the env's scripted
opponents, each agent in the roles it plays) with the given weights run in-process as ``Local``
players (local.py), prints per agent and opponent the report the in-run evaluation gives
(evaluation.py ``score``: score ± standard error, wins/draws/losses, illegal rate, per-role
scores), and writes them as JSON (docs/architecture.md §8). No Redis, engines or trainers are
started. ``--checkpoint DIR`` values (a model directory, or a LoRA adapter directory as a LoRA run
publishes: its base merged with it) without ``AGENT=`` go to the config's training agents in
order; agents without one use their model_path.
The launcher calls ``main`` in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from services.common.adapter_dir import base_of, is_adapter_dir
from services.common.cli_args import EVAL_DESCRIPTION, add_eval_arguments
from services.contracts.config import ConfigError, TandemConfig, load_config
from services.contracts.messages import SamplingParams
from services.contracts.players import Local, Player
from services.envs.base import Environment
from services.envs.registry import check_environment_config, check_scripted
from services.play.episode import EpisodeResult, play_episode
from services.play.evaluation import eval_roles, evaluate_against, fmt_report
from services.play.local import LocalPlayers


def assign_checkpoints(cfg: TandemConfig, values: list[str]) -> dict[str, str]:
    """agent -> weights directory. Raises ConfigError naming the bad --checkpoint."""
    trained = [a for a, c in cfg.agents.items() if c.train]
    out = {a: c.model_path for a, c in cfg.agents.items() if c.train}
    plain = 0
    for value in values:
        agent, sep, path = value.partition("=")
        if not sep:
            if plain >= len(trained):
                raise ConfigError(f"--checkpoint {value}: more plain checkpoints than training agents {trained}")
            agent, path = trained[plain], value
            plain += 1
        if agent not in cfg.agents:
            raise ConfigError(f"--checkpoint {value}: no agent {agent!r} in the config ({', '.join(cfg.agents)})")
        check_weights(value, path)
        out[agent] = path
    return out


def check_weights(value: str, path: str) -> None:
    """A model directory, or a LoRA adapter directory (what a LoRA run publishes) whose base is one."""
    if (Path(path) / "config.json").is_file():
        return
    if not is_adapter_dir(path):
        raise ConfigError(f"--checkpoint {value}: {path} is neither a model directory (config.json) nor a LoRA "
                          "adapter directory (adapter_config.json)")
    try:
        base = base_of(path)
    except ValueError as exc:
        raise ConfigError(f"--checkpoint {value}: {exc}") from exc
    if not (Path(base) / "config.json").is_file():
        raise ConfigError(f"--checkpoint {value}: the adapter's base model {base} is not a model directory")


async def run_eval(cfg: TandemConfig, checkpoints: dict[str, str], opponents: list[str | dict[str, str]],
                   episodes: int, local: LocalPlayers | None = None) -> dict[str, Any]:
    env_cls = check_environment_config(cfg.environment)
    local = local or LocalPlayers()
    ev = cfg.environment.eval
    results: dict[str, Any] = {}
    for agent, path in checkpoints.items():
        player = Local(path=path, agent=agent)
        tokenizers = {player: await asyncio.to_thread(local.tokenizer, path)}
        context = {player: await asyncio.to_thread(local.context_length, path)}

        async def play(env: Environment, gid: str, mapping: dict[str, Player], sampling: dict[Player, SamplingParams],
                       rng: random.Random, tokenizers: dict[Player, Any] = tokenizers,
                       context: dict[Player, int] = context) -> EpisodeResult:
            return await play_episode(env, uuid.uuid4().hex, gid, mapping, tokenizers, sampling, local.generate,
                                      "eval", rng, context)

        roles = eval_roles(cfg.environment, env_cls, agent)
        results[agent] = {"checkpoint": path, "roles": roles, "vs": await evaluate_against(
            env_cls, cfg.environment, player, roles, opponents, episodes, cfg.agents[agent].sampling,
            ev.temperature, play)}
    return {"environment": cfg.environment.name, "episodes": episodes, "temperature": ev.temperature,
            "time": time.time(), "agents": results}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, TandemConfig, dict[str, str],
                                                 list[str | dict[str, str]], int]:
    """The command line, checked against the config; ConfigError/ValueError name the bad argument."""
    parser = argparse.ArgumentParser(prog="tandem eval", description=EVAL_DESCRIPTION)
    add_eval_arguments(parser)
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    env_cls = check_environment_config(cfg.environment)
    checkpoints = assign_checkpoints(cfg, args.checkpoint)
    opponents: list[str | dict[str, str]] = list(args.opponent) or cfg.environment.eval.opponent_list()
    fixed = cfg.environment.scripted()
    for o in args.opponent:
        for role in env_cls.roles:
            if role not in fixed:
                check_scripted(env_cls, role, o, f"--opponent {o}")
    episodes = cfg.environment.eval.episodes if args.episodes is None else args.episodes
    if episodes < 1:
        raise ConfigError("--episodes: must be at least 1 (or set environment.eval.episodes)")
    return args, cfg, checkpoints, opponents, episodes


def main(argv: list[str] | None = None) -> int:
    try:
        args, cfg, checkpoints, opponents, episodes = parse_args(argv)
    except (ConfigError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    local = LocalPlayers()
    try:
        report = asyncio.run(run_eval(cfg, checkpoints, opponents, episodes, local))
    finally:
        local.close()
    for agent, r in report["agents"].items():
        for opponent, s in r["vs"].items():
            roles = " ".join(f"{k}={'-' if v is None else f'{v:.3f}'}" for k, v in s["per_role"].items())
            head = f"score {fmt_report(s)}  ({roles}; " if s.get("game", True) else f"{fmt_report(s)}  ("
            print(f"{agent} vs {opponent}: {head}{s['episodes']} episodes, {r['checkpoint']})")
    out = Path(args.out) if args.out else cfg.run_dir() / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")
    return 0
