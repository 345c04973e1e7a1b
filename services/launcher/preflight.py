"""Checks made before any service starts, each naming the config field at fault.

``tandem validate`` and ``tandem up`` run them all before anything on disk or in Redis is touched:
the environment's parameters, free ports, model directories, that Redis answers (an external
``redis_url``) or can be started (the embedded one), and, for ``up``, what the run already has:
a run with state is continued only with ``--resume`` and wiped only with ``--fresh``.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import redis

from services.common.embedded_redis import server_binary
from services.common.extras import missing
from services.contracts.config import ConfigError, TandemConfig
from services.envs.registry import check_environment_config

Mode = Literal["validate", "new", "resume", "fresh"]


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``port``: bound as the servers bind it (SO_REUSEADDR, as uvicorn and the
    router do), so connections of a run just stopped, left in TIME_WAIT, do not count as the port in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def redacted(url: str) -> str:
    """The URL without its password (for messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_problem(url: str, timeout: float = 3.0) -> str | None:
    """Why the Redis at ``url`` cannot be used (malformed, unreachable, wrong password), or None."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    except ValueError as exc:
        return f"redis_url: {redacted(url)!r} is not a Redis URL ({exc})"
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        return f"redis_url: {redacted(url)} refused the password ({exc})"
    except (redis.RedisError, OSError) as exc:
        return f"redis_url: cannot reach {redacted(url)} ({exc})"
    finally:
        client.close()
    return None


def run_state(cfg: TandemConfig) -> list[str]:
    """What an earlier run of this name left: its directory, checkpoints and Redis keys (a Redis that
    cannot be reached is reported by ``redis_problem``; it counts as no keys here)."""
    found = []
    for what, path in (("run directory", cfg.run_dir()), ("checkpoints", Path(cfg.run.checkpoint_root) /
                                                          cfg.run.name)):
        if path.is_dir() and any(path.iterdir()):
            found.append(f"{what} {path}")
    if cfg.redis_url:
        try:
            client = redis.Redis.from_url(cfg.redis_url, socket_connect_timeout=3, socket_timeout=3)
            try:
                keys = next(iter(client.scan_iter(match=f"tandem:{cfg.run.name}:*", count=1000)), None)
            finally:
                client.close()
            if keys is not None:
                found.append(f"keys tandem:{cfg.run.name}:* in {redacted(cfg.redis_url)}")
        except (redis.RedisError, OSError, ValueError):
            pass
    return found


def state_problem(cfg: TandemConfig, source: str, mode: Mode) -> str | None:
    if mode in ("validate", "fresh"):
        return None
    found = run_state(cfg)
    if mode == "new" and found:
        return (f"run.name: run {cfg.run.name!r} already has state ({'; '.join(found)}). "
                f"`tandem up {source} --resume` continues it; `tandem up {source} --fresh` deletes it and "
                "starts over (or choose another run.name)")
    if mode == "resume" and not found:
        return f"run.name: run {cfg.run.name!r} has no state to resume; start it without --resume"
    return None


def preflight(cfg: TandemConfig, source: str, mode: Mode = "validate") -> None:
    """Raise ``ConfigError`` listing every problem; touches nothing on disk or in Redis."""
    problems: list[str] = []
    if cfg.redis_url:
        if (problem := redis_problem(cfg.redis_url)) is not None:
            problems.append(problem)
    else:
        try:
            server_binary()
        except RuntimeError as exc:
            problems.append(f"redis_url: empty (embedded Redis), but {exc}")
    try:
        check_environment_config(cfg.environment)
    except ValueError as exc:
        problems.append(str(exc))
    if cfg.api.port and not port_is_free(cfg.api.host, cfg.api.port):
        problems.append(f"api.port: {cfg.api.host}:{cfg.api.port} is in use (0 picks a free port)")
    for name, agent in cfg.agents.items():
        path = Path(agent.model_path)
        if not (path / "config.json").is_file():
            task = " --task guess" if "guess" in path.name else ""
            hint = f" (run `tandem init-demo{task} {path}` to create the demo model)" if "demo" in path.name else (
                f" (run `tandem init-model smollm2 {path}` to convert the model)" if "smollm2" in path.name else "")
            problems.append(f"agents.{name}.model_path: {path} is not a model directory{hint}")
        if agent.sft is not None and mode != "validate":
            problems.append(f"agents.{name}.sft: tandem up trains on live samples; a dataset is trained by `tandem "
                            "sft` (then set model_path to its checkpoint) or by `tandem pipeline`")
        if agent.router_port and not port_is_free("127.0.0.1", agent.router_port):
            problems.append(f"agents.{name}.router_port: {agent.router_port} is in use (0 picks a free port)")
        base = agent.engine_base_port
        busy = [p for p in range(base, base + agent.num_engines) if base and not port_is_free("127.0.0.1", p)]
        if busy:
            problems.append(f"agents.{name}.engine_base_port: port(s) {busy} in use (0 picks free ports)")
    problems.extend(port_clashes(cfg))
    problems.extend(extras_problems(cfg))
    if problems:
        what = "not ready to run" if mode == "validate" else "cannot start"
        raise ConfigError(f"{source}: {what}:\n  " + "\n  ".join(problems))
    if (problem := state_problem(cfg, source, mode)) is not None:
        raise ConfigError(f"{source}: refused, to keep an earlier run's data:\n  {problem}")


def extras_problems(cfg: TandemConfig) -> list[str]:
    """The optional packages the config asks for and this install lacks, each naming its extra."""
    wanted = [(f"agents.{name}.backend: megatron", "megatron") for name, a in cfg.agents.items()
              if a.backend == "megatron"]
    wanted += [(f"agents.{name}.lora", "lora") for name, a in cfg.agents.items() if a.lora is not None]
    if cfg.logging.wandb is not None and cfg.logging.wandb.mode != "disabled":
        wanted.append(("logging.wandb", "wandb"))
    return [m for what, extra in wanted if (m := missing(extra, what)) is not None]
