"""The environment interface (docs/architecture.md §8), in the spirit of the Tinker cookbook's Env.

An environment is one episode between named roles. The coordinator asks it
whose turn it is, gives it the acting role's new observation (text the role
sees since its last turn), passes that role's reply, and at the end reads the
per-role rewards. ``make_group`` builds the G copies that share a GRPO
baseline (same seed, so the same start). ``scripted_reply`` plays a role
without a model (evaluation opponents, tests, ``scripted:<player>`` roles).
Per-turn rewards (``StepResult.turn_rewards``) are optional; the coordinator
adds them to the final rewards. The parameters (``environment.params``) are the
class's ``Params``, a pydantic model (params.py), declared once as the type argument
(``class TicTacToe(Environment[TicTacToeParams])``); ``self.params`` is an instance.
``render`` (optional) draws a state for the
dashboard's transcript browser: HTML or text, as ``render_format`` says.
``default_system`` holds, per role, the system message that tells a chat model the protocol;
``environment.params.system`` (``ChatParams``) replaces it per role, '' for none.
``default_tools`` names, per role, the tools (services/envs/tools) a model player may call within its turn.
``demonstration`` writes what a competent player of a role would, tool calls included (SFT warm-up data).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, cast, get_args

from services.envs.params import EnvParamError, EnvParams, NoParams, validate

__all__ = ["Environment", "EnvParamError", "EnvParams", "StepResult", "score_for"]

P = TypeVar("P", bound=EnvParams)


@dataclass
class StepResult:
    done: bool
    rewards: dict[str, float] = field(default_factory=dict)  # per role, final when done
    turn_rewards: dict[str, float] = field(default_factory=dict)  # optional, per role this turn
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC, Generic[P]):
    roles: ClassVar[tuple[str, ...]]
    description: ClassVar[str] = ""
    scripted_players: ClassVar[tuple[str, ...]] = ("random",)
    # scripted player -> the roles it can play (a player not listed can play every role)
    scripted_roles: ClassVar[dict[str, tuple[str, ...]]] = {}
    # the parameters (``environment.params``), a pydantic model: the type argument ``P`` of a subclass
    # (``Environment[XParams]``) or set directly; ``env_name`` starts its error messages
    Params: ClassVar[type[EnvParams]] = NoParams
    params: P
    env_name: ClassVar[str] = ""
    render_format: ClassVar[str] = "text"  # what ``render`` returns: "text" or "html" (a fragment)
    # the fields of ``summary()`` that evaluations average (``summary_means``); None: every number in it
    summary_measures: ClassVar[tuple[str, ...] | None] = None
    # per role, the system message that tells a chat model the protocol (``params.system`` replaces it)
    default_system: ClassVar[dict[str, str]] = {}
    # per role, the tools it may call (services/envs/tools; ``params.tools`` of ``ToolParams`` replaces it)
    default_tools: ClassVar[dict[str, tuple[str, ...]]] = {}
    # roles ``demonstration`` can play (collect's scripted warm-up data)
    demonstrated_roles: ClassVar[tuple[str, ...]] = ()
    # a game: the final rewards say who won (win/draw/loss scores); otherwise evaluations report summary_means
    is_game: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """``class X(Environment[XParams])`` (or a generic base's ``[XParams]``): X's ``Params`` is XParams."""
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            args = get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], EnvParams):
                cls.Params = args[0]

    def __init__(self, params: Mapping[str, Any] | EnvParams, seed: int) -> None:
        self.params = cast(P, self.check_params(params))
        self.seed = seed
        self.rng = random.Random(seed)

    @classmethod
    def check_params(cls, params: Mapping[str, Any] | EnvParams) -> EnvParams:
        """``params`` validated as ``Params``; raises EnvParamError naming the bad parameter."""
        name = cls.env_name or cls.__name__
        checked = validate(name, cls.Params, params)
        for per_role in ("system", "tools"):  # parameters keyed by role
            unknown = [r for r in getattr(checked, per_role, None) or {} if r not in cls.roles]
            if unknown:
                raise EnvParamError(f"{name}: {per_role}.{unknown[0]}: no such role (roles: {', '.join(cls.roles)})",
                                    f"{per_role}.{unknown[0]}")
        return checked

    @abstractmethod
    def current_role(self) -> str:
        """The role that acts next."""

    @abstractmethod
    def observation(self, role: str) -> str:
        """What ``role`` sees now, as the text of one user message."""

    @abstractmethod
    async def step(self, role: str, reply: str) -> StepResult:
        """Apply ``role``'s reply. Unparseable replies get the env's stated penalty."""

    def check_turn(self, role: str) -> None:
        """Raise ValueError unless ``role`` is the one that acts now (``current_role``)."""
        if role != self.current_role():
            raise ValueError(f"it is {self.current_role()}'s turn, not {role!r}'s")

    def turn_result(self, turn_rewards: dict[str, float], info: dict[str, Any], out_of_turns: bool = False
                    ) -> StepResult:
        """A turn that does not decide the episode: it goes on, or, ``out_of_turns`` (its turn limit), ends with
        no final reward for any role."""
        if out_of_turns:
            return StepResult(done=True, rewards=dict.fromkeys(self.roles, 0.0), turn_rewards=turn_rewards, info=info)
        return StepResult(done=False, turn_rewards=turn_rewards, info=info)

    @abstractmethod
    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        """A reply for ``role`` by the scripted ``player`` (one of scripted_players)."""

    def system_prompt(self, role: str) -> str | None:
        """The system message for ``role``'s chat (rendered by its agent's template): ``params.system``'s for the
        role when it has one ('' for none), else ``default_system``'s; None when there is none."""
        override: dict[str, str] = getattr(self.params, "system", {})
        text = override[role] if role in override else self.default_system_prompt(role)
        return text or None

    def default_system_prompt(self, role: str) -> str:
        """``role``'s default system message ('' for none): ``default_system``'s."""
        return self.default_system.get(role, "")

    def tool_names(self, role: str) -> tuple[str, ...]:
        """The tools ``role`` may call: ``params.tools``'s for the role when set, else ``default_tools``'s."""
        chosen: dict[str, list[str]] | None = getattr(self.params, "tools", None)
        if chosen is not None:
            return tuple(chosen.get(role, ()))
        return self.default_tools.get(role, ())

    def demonstration(self, role: str, step: int) -> str:
        """What a competent player of ``role`` writes as generation ``step`` of its current turn (0 first, then
        one after each tool call's result): supervised warm-up data (``tandem collect --demonstrate``). Roles an
        environment can demonstrate are its ``demonstrated_roles``; any other raises ``ValueError``."""
        raise ValueError(f"environment {self.env_name or type(self).__name__} cannot demonstrate role {role!r} "
                         f"(it demonstrates: {', '.join(self.demonstrated_roles) or 'none'})")

    def needs_tools(self, role: str, *names: str) -> None:
        """A demonstration's check that ``role`` may call the tools it would: a call to a tool the config does not
        give the role would teach the model a call that fails."""
        if missing := [n for n in names if n not in self.tool_names(role)]:
            given = ", ".join(self.tool_names(role)) or "none"
            raise ValueError(f"the demonstration of role {role!r} calls {', '.join(missing)}, which "
                             f"environment.params.tools does not give it ({given})")

    def tool_used(self, role: str, call: dict[str, Any]) -> None:
        """Told of each tool call ``role`` made (name, arguments, result, error) before its turn's reply is
        stepped; the default ignores it (an environment may count or grade tool use)."""

    def summary(self) -> dict[str, Any]:
        """A small JSON-able description of the episode's state/outcome."""
        return {}

    @classmethod
    def render(cls, state: dict[str, Any]) -> str | None:
        """Draw an episode state (a ``summary()`` dict) for people: ``render_format`` text or an HTML
        fragment, or None when the environment has no drawing (the default)."""
        return None

    @classmethod
    def evaluation_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters evaluations play: ``params`` with a ``dataset``'s ``eval_split`` (its held-out split,
        when set) as the split tasks are drawn from, and ``split`` ``eval`` where cases are held out
        (``HeldOutParams``)."""
        dataset = params.get("dataset")
        if isinstance(dataset, Mapping) and dataset.get("eval_split"):
            params = {**params, "dataset": {**dataset, "split": dataset["eval_split"]}}
        return {**params, "split": "eval"} if params.get("held_out") else params

    @classmethod
    def make_group(cls, params: Mapping[str, Any] | EnvParams, seed: int, size: int) -> list[Environment]:
        """G copies that share a baseline: same seed, same start (parameters validated once)."""
        checked = cls.check_params(params)
        return [cls(checked, seed) for _ in range(size)]


def score_for(rewards: dict[str, float], role: str) -> float:
    """Map a final reward in [-1, 1] to an eval score in [0, 1] (win 1, draw 0.5, loss 0)."""
    return (max(-1.0, min(1.0, rewards.get(role, 0.0))) + 1.0) / 2.0
