"""Environment registry: built-in names and ``package.module:Class`` plug-ins."""

from __future__ import annotations

import importlib

from services.contracts.config import EnvironmentConfig
from services.contracts.players import Scripted, cycle_roles
from services.envs.base import Environment, EnvParamError
from services.envs.params import describe as describe_params

BUILTINS: dict[str, str] = {
    "tictactoe": "services.envs.tictactoe:TicTacToe",
    "guess_number": "services.envs.guess_number:GuessNumber",
    "twenty_questions": "services.envs.twenty_questions:TwentyQuestions",
    "answer_then_answer": "services.envs.answer_then_answer:AnswerThenAnswer",
    "debate": "services.envs.debate:Debate",
    "doctor_patient": "services.envs.doctor_patient:DoctorPatient",
    "support_desk": "services.envs.support_desk:SupportDesk",
    "explore_exploit": "services.envs.explore_exploit:ExploreExploit",
    "math": "services.envs.math_tasks:Math",
    "math_critic": "services.envs.math_tasks:MathCritic",
    "code": "services.envs.code_tasks:Code",
    "code_critic": "services.envs.code_tasks:CodeCritic",
    "textarena": "services.envs.textarena_adapter:TextArena",
    "tool_math": "services.envs.tool_tasks:ToolMath",
    "tool_relay": "services.envs.tool_tasks:ToolRelay",
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


def check_scripted(env_cls: type[Environment], role: str, player: str, where: str) -> None:
    """``player`` is a scripted player of the environment that can play ``role``."""
    if player not in env_cls.scripted_players:
        raise ValueError(f"{where}: scripted player {player!r} is not one of {env_cls.__name__}'s "
                         f"{list(env_cls.scripted_players)}")
    can = env_cls.scripted_roles.get(player, env_cls.roles)
    if role not in can:
        raise ValueError(f"{where}: scripted player {player!r} cannot play {role!r} (only {list(can)})")


def check_environment_config(env_cfg: EnvironmentConfig) -> type[Environment]:
    """Load the environment and check its params, roles and eval opponent against it.

    Raises ValueError whose message starts with the config field at fault."""
    try:
        env_cls = load_environment(env_cfg.name)
    except ValueError as exc:
        raise ValueError(f"environment.name: {exc}") from None
    _check_params(env_cls, env_cfg)
    missing = [r for r in env_cls.roles if r not in env_cfg.roles]
    extra = [r for r in env_cfg.roles if r not in env_cls.roles]
    if missing or extra:
        raise ValueError(f"environment.roles: {env_cls.__name__} has roles {list(env_cls.roles)}; "
                         f"missing {missing}, unknown {extra}")
    for role, player in env_cfg.scripted().items():
        check_scripted(env_cls, role, player.name, f"environment.roles.{role}")
    for field, mapping in env_cfg.training_maps():  # every seat a group can give a scripted player
        for i in range(len(env_cls.roles) if env_cfg.alternate_roles else 1):  # the coordinator's rotations
            seats = cycle_roles(list(env_cfg.roles), [mapping], True, i)
            for role, player in seats.items():
                if isinstance(player, Scripted) and (i or field != "environment.roles"):  # roles: checked above
                    check_scripted(env_cls, role, player.name, f"{field}.{role}" if not i else
                                   f"environment.alternate_roles (rotated: {field} puts {player} in {role})")
    if env_cfg.eval.episodes:
        field = "opponents" if env_cfg.eval.opponents else "opponent"
        for i, opponent in enumerate(env_cfg.eval.opponent_list()):
            _check_opponent(env_cls, env_cfg, opponent,
                            f"environment.eval.{field}" + (f"[{i}]" if env_cfg.eval.opponents else ""))
    return env_cls


def takes_dataset(env_cls: type[Environment]) -> bool:
    return "dataset" in env_cls.Params.model_fields


def _check_params(env_cls: type[Environment], env_cfg: EnvironmentConfig) -> None:
    """The environment's parameters, ``environment.dataset`` among them, each fault naming its field."""
    if env_cfg.dataset is not None and not takes_dataset(env_cls):
        with_one = [n for n in BUILTINS if takes_dataset(load_environment(n))]
        raise ValueError(f"environment.dataset: {env_cfg.name} takes no dataset (the environments that do: "
                         f"{', '.join(with_one)})")
    try:
        env_cls.check_params(env_cfg.env_params())
    except EnvParamError as exc:  # names the parameter: environment.params.high: guess_number: high ...
        top = env_cfg.dataset is not None and exc.field.split(".")[0] == "dataset"  # environment.dataset's fault
        raise ValueError(f"environment{'' if top else '.params'}{'.' + exc.field if exc.field else ''}: {exc}"
                         ) from None


def _check_opponent(env_cls: type[Environment], env_cfg: EnvironmentConfig, opponent: str | dict[str, str],
                    field: str) -> None:
    fixed = set(env_cfg.scripted())  # they keep their player
    per_role = opponent if isinstance(opponent, dict) else {r: opponent for r in env_cls.roles if r not in fixed}
    for role, player in per_role.items():
        where = field + (f".{role}" if isinstance(opponent, dict) else "")
        if role not in env_cls.roles:
            raise ValueError(f"{where}: {env_cls.__name__} has no role {role!r} ({list(env_cls.roles)})")
        check_scripted(env_cls, role, player, where)
    missing = [r for r in env_cls.roles if r not in fixed and r not in per_role]
    if missing:
        raise ValueError(f"{field}: no scripted player for role(s) {missing}")


def describe_environments() -> str:
    """Per built-in: name, roles, scripted players, description and one line per parameter."""
    lines = []
    for name in BUILTINS:
        cls = load_environment(name)
        lines.append(f"{name:<20} roles: {', '.join(cls.roles):<24} scripted: {', '.join(cls.scripted_players)}")
        lines.append(f"{'':<20} {cls.description}")
        lines.extend(f"{'':<20}   {line}" for line in describe_params(cls.Params))
    lines.append("plug-ins: any package.module:Class subclass of services.envs.base.Environment")
    return "\n".join(lines)
