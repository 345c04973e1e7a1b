"""TextArena adapter: any two-player game of the ``textarena`` package as a Tandem environment.

``params.game`` is a TextArena id (``TicTacToe-v0``, ``ConnectFour-v0``, ...);
the adapter runs its ``-raw`` registration (no TextArena wrappers), so each
role's observation is exactly the messages that arrived since its last turn,
as ``[GAME] ...`` and ``[Player k] ...`` lines (the role's own moves are left
out: its view already holds them). Roles ``P0`` and ``P1`` are TextArena's
players 0 and 1. ``params.kwargs`` go to the game's constructor.

Rules, rewards and malformed replies are the game's own: TextArena tells the
player its move was invalid and, past the game's error allowance (one retry
by default), ends the game as a loss for that player. Final rewards are
TextArena's (win +1, loss -1, draw 0).

Offline use: board and card games (TicTacToe, ConnectFour, Nim, KuhnPoker,
...) need nothing at run time; TextArena's word games (Hangman, Wordle,
Codenames, ...) call ``nltk.download`` when their module is imported, which
needs network access (or the NLTK data installed beforehand).

Scripted player ``random``: a random move among those the game lists
(quoted ``'[...]'`` options such as TicTacToe's available moves), or else one
of the game's bracketed examples with random digits.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator

from services.common.extras import missing
from services.envs.base import Environment, EnvParamError, StepResult
from services.envs.params import EnvParams

OPTION = re.compile(r"'(\[[^\]\n]{1,40}\])'")


def _textarena() -> Any:
    if (message := missing("textarena", "environment textarena")) is not None:
        raise EnvParamError(message)
    import textarena

    return textarena


class TextArenaParams(EnvParams):
    game: str = Field(description="a TextArena id such as 'TicTacToe-v0'")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="the game's constructor arguments")

    @field_validator("game")
    @classmethod
    def _registered(cls, game: str) -> str:
        _textarena()
        from textarena.envs.registration import ENV_REGISTRY

        if f"{game}-raw" not in ENV_REGISTRY:
            raise ValueError("not a registered TextArena id")
        return game

    @field_validator("kwargs")
    @classmethod
    def _starts(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        game = info.data.get("game")
        if game is None:  # the game itself is at fault (named above)
            return kwargs
        try:
            env = _textarena().make(f"{game}-raw", **kwargs)
            env.reset(num_players=2, seed=0)
        except Exception as exc:
            raise ValueError(f"game {game!r} cannot start with two players with them: {exc}") from None
        return kwargs


class TextArena(Environment[TextArenaParams]):
    roles: ClassVar[tuple[str, ...]] = ("P0", "P1")
    description: ClassVar[str] = ("Any two-player TextArena game by id (params.game); the game's own rules, "
                                  "invalid-move handling and +1/-1/0 rewards.")
    scripted_players: ClassVar[tuple[str, ...]] = ("random",)
    env_name: ClassVar[str] = "textarena"
    is_game: ClassVar[bool] = True  # two-player games: win, draw or loss

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        ta = _textarena()
        self.game = ta.make(f"{self.params.game}-raw", **self.params.kwargs)
        self.game.reset(num_players=2, seed=seed)
        self.player, self.pending = self._fetch()
        self.seen: dict[int, list[str]] = {0: [], 1: []}  # every message each player received (scripted player)
        self.done = False
        self.rewards: dict[str, float] = {}
        self.info: dict[str, Any] = {}

    def _fetch(self) -> tuple[int, str]:
        pid, messages = self.game.get_observation()
        lines = [("[GAME] " if src == -1 else f"[Player {src}] ") + str(msg)
                 for src, msg, *_ in messages if src != pid]
        return int(pid), "\n".join(lines)

    def current_role(self) -> str:
        return f"P{self.player}"

    def observation(self, role: str) -> str:
        return self.pending

    async def step(self, role: str, reply: str) -> StepResult:
        if self.done:
            raise RuntimeError("the episode is over")
        self.check_turn(role)
        self.seen[self.player].append(self.pending)
        done, _ = self.game.step(reply.strip())
        if done:
            self.done = True
            rewards, info = self.game.close()
            self.rewards = {f"P{p}": float(r) for p, r in (rewards or {}).items()}
            self.info = {f"P{p}": {k: v for k, v in i.items() if isinstance(v, str | int | float | bool)}
                         for p, i in (info or {}).items()}
            return StepResult(done=True, rewards=self.rewards, info=self.info)
        self.player, self.pending = self._fetch()
        return StepResult(done=False)

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if player != "random":
            raise ValueError(f"unknown scripted player {player!r}; choose from {self.scripted_players}")
        options = OPTION.findall(self.pending.split("[GAME]")[-1]) if "[GAME]" in self.pending else []
        if options:
            return rng.choice(options)
        examples = re.findall(r"\[[^\]\n]{1,40}\]", "\n".join([*self.seen[self.player], self.pending]))
        examples = [e for e in examples if not e.startswith(("[GAME", "[Player"))] or ["[0]"]
        return re.sub(r"\d", lambda _: str(rng.randint(0, 6)), rng.choice(examples))

    def summary(self) -> dict[str, Any]:
        return {"game": self.params.game, "rewards": self.rewards, "info": self.info}
