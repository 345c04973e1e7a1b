"""A run config's training loop in one process: the bar ``tandem up`` is timed against (bench_llm_system).

The same work as the services, without them: each agent a ``TorchPolicy`` built from its own ``AgentConfig``
(LoRA, algorithm, micro-batches, seed) and an in-process inference ``Engine`` set up as ``tandem up``'s
embedded engine is (``max_inflight_per_engine`` rows, dtype, prefix cache, admission windows). Each step
plays, all at once, the groups the coordinator would launch next (``environment.group_roles``, seeded as
coordinator/groups.py seeds them, with the agents' ``sampling``) until every trained agent has its
``groups_per_batch`` groups, through services/play's ``play_episode``; then each agent trains on its
samples, saves the new version and its engine loads it (under LoRA as the named adapter ``{agent}-v{n}``
its turns are then generated under, the old one unloaded, as the rollout does). ``max_staleness: 0``
is what this loop is: every step's episodes are played on the latest weights.

    PYTHONPATH=. python tests/bench/inprocess_loop.py configs/llm_answer.yaml --steps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

from services.contracts.config import TandemConfig, load_config  # noqa: E402
from services.contracts.messages import GenerateReply, GenerateRequest, Sample  # noqa: E402
from services.contracts.players import AgentPlayer, Player  # noqa: E402
from services.envs.registry import load_environment  # noqa: E402
from services.inference.generator import Engine  # noqa: E402
from services.play.episode import EpisodeResult, group_samples  # noqa: E402
from services.play.local import EnginePlayers, generate_on  # noqa: E402
from services.training.torch_backend import TorchPolicy  # noqa: E402

# the embedded engine's admission windows (services/engine/__main__.py defaults)
ADMIT_QUIET_S, ADMIT_WINDOW_S = 0.002, 0.02


def step_groups(cfg: TandemConfig, start: int) -> list[int]:
    """Group indices from ``start`` on until each trained agent is in ``groups_per_batch`` of them."""
    need = {a: acfg.groups_per_batch for a, acfg in cfg.agents.items()}
    out, index = [], start
    while any(n > 0 for n in need.values()):
        agents = {p.agent for p in cfg.environment.group_roles(index).values() if isinstance(p, AgentPlayer)}
        if not agents & need.keys():
            raise ValueError(f"group {index} trains no agent of the config")
        for a in agents & need.keys():
            need[a] -= 1
        out.append(index)
        index += 1
    return out


class AdapterPlayers(EnginePlayers):
    """In-process agents whose turns run under their engine's current adapter (None: the engine's weights)."""

    def __init__(self, engines: dict[str, Engine]) -> None:
        super().__init__(engines)
        self.adapter: dict[str, str | None] = dict.fromkeys(engines)
        self.version = dict.fromkeys(engines, 0)

    async def generate(self, player: Player, req: GenerateRequest) -> GenerateReply:
        if not isinstance(player, AgentPlayer) or player.agent not in self.engines:
            raise ValueError(f"{player} has no in-process engine")
        return await generate_on(self.engines[player.agent], req, f"inprocess:{player.agent}",
                                 weight_version=self.version[player.agent], lora=self.adapter[player.agent])

    async def load(self, agent: str, path: Path, version: int, lora: bool) -> None:
        """Serve ``path`` as ``agent``'s version ``version`` (an adapter by name, or the full weights)."""
        engine, self.version[agent] = self.engines[agent], version
        if not lora:
            await engine.update_weights(str(path), version)
            return
        name, old = f"{agent}-v{version}", self.adapter[agent]
        await engine.adapters.load(name, str(path))
        self.adapter[agent] = name
        if old is not None:
            await engine.adapters.unload(old, engine.names_adapter)


async def play_groups(cfg: TandemConfig, players: AdapterPlayers, indices: list[int]) -> dict[str, list[Sample]]:
    """Play the groups (every episode at once) and return each agent's samples, as the coordinator emits them."""
    env_cls = load_environment(cfg.environment.name)
    sampling = {AgentPlayer(agent=a): acfg.sampling for a, acfg in cfg.agents.items()}

    async def group(index: int) -> list[EpisodeResult]:
        roles = cfg.environment.group_roles(index)
        seed, gid = cfg.run.seed * 1_000_003 + index, f"g{index:06d}"
        envs = env_cls.make_group(cfg.environment.env_params(), seed, cfg.environment.group_size)
        return list(await asyncio.gather(*(players.play(e, f"{gid}-e{n}", gid, roles, sampling, "train", None)
                                           for n, e in enumerate(envs))))

    out: dict[str, list[Sample]] = {a: [] for a in cfg.agents}
    for done in await asyncio.gather(*(group(i) for i in indices)):
        counts = group_samples(done, list(cfg.agents))
        for sample in (s for r in done for s in r.samples(counts)):
            out[sample.agent].append(sample)
    return out


def make_engine(cfg: TandemConfig, agent: str) -> Engine:
    acfg = cfg.agents[agent]
    return Engine(acfg.model_path, weight_version=0, max_batch=acfg.max_inflight_per_engine,
                  admit_quiet_s=ADMIT_QUIET_S, admit_window_s=ADMIT_WINDOW_S, device=acfg.embedded.device,
                  dtype=acfg.embedded.dtype, prefix_cache_mb=acfg.embedded.prefix_cache_mb)


async def run(cfg: TandemConfig, steps: int, log: Any = None) -> list[dict[str, Any]]:
    """``steps`` training steps of ``cfg``; per step its seconds: all, playing, training, saving + loading."""
    if any(acfg.filter_zero_variance for acfg in cfg.agents.values()):
        raise ValueError("filter_zero_variance is not played by the in-process loop")
    torch.manual_seed(cfg.run.seed)
    threads = torch.get_num_threads()
    policies = {a: TorchPolicy(acfg, temperature=acfg.sampling.temperature) for a, acfg in cfg.agents.items()}
    players = AdapterPlayers({a: make_engine(cfg, a) for a in cfg.agents})
    torch.set_num_threads(threads)  # the engines ask for one thread; the trainers keep the process's
    weights = Path(tempfile.mkdtemp(prefix="inprocess_loop_"))
    rows, index = [], 0
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            indices = step_groups(cfg, index)
            index = indices[-1] + 1
            samples = await play_groups(cfg, players, indices)
            t_play = time.perf_counter()
            train_s = sync_s = 0.0
            for agent, policy in policies.items():
                t1 = time.perf_counter()
                policy.train_step(samples[agent])
                t2 = time.perf_counter()
                path, _ = policy.save(weights / f"{agent}-v{policy.weight_version}")
                await players.load(agent, path, policy.weight_version, cfg.agents[agent].lora is not None)
                train_s, sync_s = train_s + t2 - t1, sync_s + time.perf_counter() - t2
            row = {"step": step + 1, "seconds": round(time.perf_counter() - t0, 3), "play_s": round(t_play - t0, 3),
                   "train_s": round(train_s, 3), "sync_s": round(sync_s, 3), "groups": len(indices),
                   "samples": {a: len(s) for a, s in samples.items()}, "threads": threads}
            rows.append(row)
            if log is not None:
                print(json.dumps(row), file=log, flush=True)
    finally:
        players.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    asyncio.run(run(load_config(args.config), args.steps, sys.stdout))


if __name__ == "__main__":
    main()
