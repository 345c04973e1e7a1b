"""Configs played in process: each config of ``IN_PROCESS`` (tests/e2e/test_env_runs.py) loads, passes every check
``tandem up`` makes before it starts, and plays its training matchups and its evaluation on in-process engines
of the warm demo model, through the coordinator's own episode code (services/play).

Their services are those of the configs run through ``tandem up`` there; only the environment and its parameters
differ, and this is where those are played: every trained agent gets samples that are token-exact (tokens, loss
mask and logprobs aligned, its turns inside them) with a finite reward, and every evaluation opponent plays its
episodes to a win, draw or loss.
"""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.contracts.config import TandemConfig, parse_config
from services.contracts.players import AgentPlayer
from services.envs.registry import check_environment_config
from services.inference.generator import Engine
from services.launcher.preflight import extras_problems
from services.play.episode import EpisodeResult, group_samples
from services.play.evaluation import eval_roles, evaluate_against
from services.play.local import EnginePlayers
from tests.e2e.test_env_runs import IN_PROCESS

REPO = Path(__file__).resolve().parents[2]
EPISODES = 2  # per training matchup, and per evaluation opponent


def config(name: str, model: Path) -> TandemConfig:
    data = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    for agent in data["agents"].values():
        agent["model_path"] = str(model)
    return parse_config({**data, "redis_url": ""}, name)


async def play(cfg: TandemConfig) -> tuple[list[EpisodeResult], dict[str, dict[str, Any]]]:
    """Every training matchup's episodes (both ways round where the config alternates the roles), then each trained
    agent's evaluation against every opponent."""
    env_cls = check_environment_config(cfg.environment)
    env_cfg = cfg.environment
    players = EnginePlayers({a: Engine(c.model_path) for a, c in cfg.agents.items()})
    sampling = {AgentPlayer(agent=a): c.sampling for a, c in cfg.agents.items()}
    try:
        results: list[EpisodeResult] = []
        seatings = len(env_cfg.training_maps()) * (2 if env_cfg.alternate_roles else 1)  # each map, sides swapped
        for index in range(seatings):
            roles = env_cfg.group_roles(index)
            results += await asyncio.gather(*(players.play(
                env_cls(env_cfg.env_params(), seed), f"g{index}-e{seed}", f"g{index}", roles, sampling, "train",
                random.Random(seed)) for seed in range(EPISODES)))

        async def eval_play(env, gid, mapping, eval_sampling, rng):  # noqa: ANN001, ANN202 (evaluation's Play)
            return await players.play(env, gid, gid, mapping, eval_sampling, "eval", rng)

        evals = {a: await evaluate_against(env_cls, env_cfg, AgentPlayer(agent=a), eval_roles(env_cfg, env_cls, a),
                                           env_cfg.eval.opponent_list(), EPISODES, c.sampling, env_cfg.eval.temperature,
                                           eval_play)
                 for a, c in cfg.agents.items() if c.train}
        return results, evals
    finally:
        players.stop()


@pytest.mark.parametrize("name", sorted(IN_PROCESS))
def test_config_plays_in_process(name: str, warm_model_dir: Path) -> None:
    cfg = config(name, warm_model_dir)
    assert extras_problems(cfg) == []
    trained = [a for a, c in cfg.agents.items() if c.train]
    results, evals = asyncio.run(play(cfg))
    samples = [s for r in results for s in r.samples(group_samples([r], trained))]
    assert sorted({s.agent for s in samples}) == sorted(trained), f"{name}: an agent got no sample"
    for s in samples:
        assert len(s.tokens) == len(s.loss_mask) == len(s.rollout_logprobs), name
        assert all(0 <= t.start < t.end <= len(s.tokens) for t in s.turns), name
        assert math.isfinite(s.reward) and len(s.turn_rewards) == len(s.turns), name
    for agent, reports in evals.items():
        assert len(reports) == len(cfg.environment.eval.opponent_list()), agent
        for report in reports.values():
            assert report["wins"] + report["draws"] + report["losses"] == report["episodes"] == EPISODES, report
