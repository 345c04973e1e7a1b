"""Checks made before any service starts, each naming the config field at fault."""

from __future__ import annotations

import socket
from pathlib import Path

from services.contracts.config import ConfigError, TandemConfig
from services.envs.registry import check_environment_config


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_clashes(cfg: TandemConfig) -> list[str]:
    """Fixed ports that two fields of one config both claim (each would bind on this machine)."""
    claims: dict[int, list[str]] = {}
    if cfg.api.port:
        claims.setdefault(cfg.api.port, []).append("api.port")
    for name, agent in cfg.agents.items():
        if agent.router_port:
            claims.setdefault(agent.router_port, []).append(f"agents.{name}.router_port")
        if agent.engine_base_port:
            for p in range(agent.engine_base_port, agent.engine_base_port + agent.num_engines):
                claims.setdefault(p, []).append(f"agents.{name}.engine_base_port")
    return [f"{' and '.join(fields)}: both use port {port}" for port, fields in sorted(claims.items())
            if len(fields) > 1]


def preflight(cfg: TandemConfig, source: str) -> None:
    problems: list[str] = []
    try:
        check_environment_config(cfg.environment)
    except ValueError as exc:
        problems.append(str(exc))
    if cfg.api.port and not port_is_free(cfg.api.host, cfg.api.port):
        problems.append(f"api.port: {cfg.api.host}:{cfg.api.port} is in use (0 picks a free port)")
    for name, agent in cfg.agents.items():
        path = Path(agent.model_path)
        if not (path / "config.json").is_file():
            hint = " (run `tandem init-demo` to create the demo model)" if "demo" in path.name else ""
            problems.append(f"agents.{name}.model_path: {path} is not a model directory{hint}")
        if agent.router_port and not port_is_free("127.0.0.1", agent.router_port):
            problems.append(f"agents.{name}.router_port: {agent.router_port} is in use (0 picks a free port)")
        base = agent.engine_base_port
        busy = [p for p in range(base, base + agent.num_engines) if base and not port_is_free("127.0.0.1", p)]
        if busy:
            problems.append(f"agents.{name}.engine_base_port: port(s) {busy} in use (0 picks free ports)")
    problems.extend(port_clashes(cfg))
    if problems:
        raise ConfigError(f"invalid config {source}:\n  " + "\n  ".join(problems))
