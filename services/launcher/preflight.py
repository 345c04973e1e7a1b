"""Checks made before any service starts, each naming the config field at fault."""

from __future__ import annotations

from pathlib import Path

from services.contracts.config import ConfigError, TandemConfig
from services.envs.registry import check_environment_config


def preflight(cfg: TandemConfig, source: str) -> None:
    problems: list[str] = []
    try:
        check_environment_config(cfg.environment)
    except ValueError as exc:
        problems.append(str(exc))
    for name, agent in cfg.agents.items():
        path = Path(agent.model_path)
        if not (path / "config.json").is_file():
            hint = " (run `tandem init-demo` to create the demo model)" if "demo" in path.name else ""
            problems.append(f"agents.{name}.model_path: {path} is not a model directory{hint}")
    if problems:
        raise ConfigError(f"invalid config {source}:\n  " + "\n  ".join(problems))
