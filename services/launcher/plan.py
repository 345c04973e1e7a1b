"""What ``tandem up`` starts, in which order and with which command lines: every service of the run.

Per agent the rollout (which starts the agent's real SGLang router and engines itself; one that shares
another agent's engines drives that agent's router instead: ``shared_fleet_env`` fixes its port and the
admin token they share), then the coordinator, then per trained agent the buffer and trainer (a new run's
once its first turn is played: services/launcher/deferred.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from services.common.admin_token import ADMIN_TOKEN_ENV, new_token, token_from_env
from services.common.embedded_redis import free_port
from services.contracts.config import AgentConfig, TandemConfig
from services.launcher.deferred import AfterFirstTurn
from services.launcher.processes import ProcessGroup, python_module


def trainer_command(acfg: AgentConfig, base: list[str]) -> list[str]:
    """The megatron backend with more than one rank runs under torchrun (rank 0 is the trainer service)."""
    lay = acfg.megatron
    ranks = lay.tensor_parallel * lay.pipeline_parallel * lay.data_parallel
    if acfg.backend == "megatron" and ranks > 1:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        return [torchrun, "--standalone", "--nproc_per_node", str(ranks), "-m", "services.trainer", *base]
    return python_module("services.trainer", *base)


def start_services(cfg: TandemConfig, config_path: str, group: ProcessGroup, api_port: int,
                   later: AfterFirstTurn | None = None) -> str:
    """Start every service; return the control API URL. Each rollout starts its agent's SGLang router
    and engines itself (embedded on CPU, ``sglang.launch_server`` with ``engine: sglang``). The order is
    the first turn's critical path: the rollouts (their engines are the slowest start), the coordinator,
    then the buffers and trainers (needed only once the first groups are played): held in ``later`` when
    given, which starts them after the first turn (services/launcher/deferred.py), else all at once."""
    base = {agent: ["--config", config_path, "--agent", agent] for agent in cfg.agents}
    for agent in cfg.agents:
        group.start(f"rollout.{agent}", python_module("services.rollout", *base[agent]))
    group.start("coordinator", python_module("services.coordinator", "--config", config_path, "--port", str(api_port)))
    trained = [agent for agent, acfg in cfg.agents.items() if acfg.train]  # a frozen agent: its rollout only
    start = later.add if later is not None else group.start
    for agent in trained:
        start(f"buffer.{agent}", python_module("services.buffer", *base[agent]))
    for agent in trained:
        start(f"trainer.{agent}", trainer_command(cfg.agents[agent], base[agent]))
    return f"http://{cfg.api.host}:{api_port}"


def shared_fleet_env(cfg: TandemConfig) -> dict[str, str]:
    """For agents that share another agent's engines (``share_engines_with``): the owner's router on a fixed
    port (a free one unless configured; every service reads it through the override) for the sharing rollouts
    to drive, and one admin token for that fleet and every rollout that drives it."""
    owners = sorted({a.share_engines_with for a in cfg.agents.values() if a.share_engines_with})
    if not owners:
        return {}
    env = {ADMIN_TOKEN_ENV: token_from_env() or new_token()}
    for owner in owners:
        if not cfg.agents[owner].router_port:
            env[f"TANDEM__agents__{owner}__router_port"] = str(free_port())
    return env
