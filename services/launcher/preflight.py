"""Checks made before any service starts, each naming the config field at fault."""

from __future__ import annotations

from pathlib import Path

from services.contracts.config import ConfigError, TandemConfig
from services.envs.base import EnvParamError
from services.envs.registry import load_environment


def preflight(cfg: TandemConfig, source: str) -> None:
    problems: list[str] = []
    try:
        env_cls = load_environment(cfg.environment.name)
    except ValueError as exc:
        problems.append(f"environment.name: {exc}")
    else:
        try:
            env_cls.check_params(cfg.environment.params)
        except EnvParamError as exc:
            problems.append(f"environment.params: {exc}")
        missing = [r for r in env_cls.roles if r not in cfg.environment.roles]
        extra = [r for r in cfg.environment.roles if r not in env_cls.roles]
        if missing or extra:
            problems.append(f"environment.roles: {env_cls.__name__} has roles {list(env_cls.roles)}; "
                            f"missing {missing}, unknown {extra}")
        if cfg.environment.eval.episodes and cfg.environment.eval.opponent not in env_cls.scripted_players:
            problems.append(f"environment.eval.opponent: {cfg.environment.eval.opponent!r} is not one of "
                            f"{list(env_cls.scripted_players)}")
    for name, agent in cfg.agents.items():
        path = Path(agent.model_path)
        if not (path / "config.json").is_file():
            hint = " (run `tandem init-demo` to create the demo model)" if "demo" in path.name else ""
            problems.append(f"agents.{name}.model_path: {path} is not a model directory{hint}")
    if problems:
        raise ConfigError(f"invalid config {source}:\n  " + "\n  ".join(problems))
