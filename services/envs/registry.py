"""Environment registry: built-in names and ``package.module:Class`` plug-ins."""

from __future__ import annotations

import importlib

from services.contracts.config import EnvironmentConfig
from services.envs.base import Environment, EnvParamError

BUILTINS: dict[str, str] = {
    "tictactoe": "services.envs.tictactoe:TicTacToe",
    "guess_number": "services.envs.guess_number:GuessNumber",
    "twenty_questions": "services.envs.twenty_questions:TwentyQuestions",
    "answer_then_answer": "services.envs.answer_then_answer:AnswerThenAnswer",
    "debate": "services.envs.debate:Debate",
    "doctor_patient": "services.envs.doctor_patient:DoctorPatient",
    "math": "services.envs.math_tasks:Math",
    "math_critic": "services.envs.math_tasks:MathCritic",
    "code": "services.envs.code_tasks:Code",
    "code_critic": "services.envs.code_tasks:CodeCritic",
    "textarena": "services.envs.textarena_adapter:TextArena",
}


def load_object(path: str) -> object:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not of the form package.module:Name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for {path!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no {attr!r}") from None


def load_environment(name: str) -> type[Environment]:
    path = BUILTINS.get(name, name)
    if ":" not in path:
        raise ValueError(f"unknown environment {name!r}; built-ins: {', '.join(sorted(BUILTINS))} "
                         "or a plug-in as package.module:Class")
    cls = load_object(path)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{path!r} is not an Environment subclass")
    return cls


def check_environment_config(env_cfg: EnvironmentConfig) -> type[Environment]:
    """Load the environment and check its params, roles and eval opponent against it.

    Raises ValueError whose message starts with the config field at fault."""
    try:
        env_cls = load_environment(env_cfg.name)
    except ValueError as exc:
        raise ValueError(f"environment.name: {exc}") from None
    try:
        env_cls.check_params(env_cfg.params)
    except EnvParamError as exc:
        raise ValueError(f"environment.params: {exc}") from None
    missing = [r for r in env_cls.roles if r not in env_cfg.roles]
    extra = [r for r in env_cfg.roles if r not in env_cls.roles]
    if missing or extra:
        raise ValueError(f"environment.roles: {env_cls.__name__} has roles {list(env_cls.roles)}; "
                         f"missing {missing}, unknown {extra}")
    for role, player in env_cfg.roles.items():
        if player.startswith("scripted:") and player[len("scripted:"):] not in env_cls.scripted_players:
            raise ValueError(f"environment.roles.{role}: scripted player {player[len('scripted:'):]!r} is not "
                             f"one of {env_cls.__name__}'s {list(env_cls.scripted_players)}")
    opponent = env_cfg.eval.opponent
    if env_cfg.eval.episodes:
        per_role = opponent if isinstance(opponent, dict) else {r: opponent for r in env_cls.roles}
        for role, player in per_role.items():
            where = "environment.eval.opponent" + (f".{role}" if isinstance(opponent, dict) else "")
            if role not in env_cls.roles:
                raise ValueError(f"{where}: {env_cls.__name__} has no role {role!r} ({list(env_cls.roles)})")
            if player not in env_cls.scripted_players:
                raise ValueError(f"{where}: {player!r} is not one of {list(env_cls.scripted_players)}")
    return env_cls


def describe_environments() -> str:
    """One line per built-in: name, roles, scripted players and description."""
    lines = []
    for name in BUILTINS:
        cls = load_environment(name)
        lines.append(f"{name:<20} roles: {', '.join(cls.roles):<24} scripted: {', '.join(cls.scripted_players)}")
        lines.append(f"{'':<20} {cls.description}")
    lines.append("plug-ins: any package.module:Class subclass of services.envs.base.Environment")
    return "\n".join(lines)
