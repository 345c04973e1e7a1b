"""Who plays a role: the typed players, parsed once from the config's strings.

The YAML names a role's player as a string: an agent name (``A``), one of the
environment's scripted players (``scripted:random``) or a past weight version
of an agent drawn from its opponent pool (``pool:A``). ``parse_player`` turns
that string into one of the models below; everything past the config reads
the type, never the string. ``Local`` (fixed weights from a directory, played
in-process) is never written in a config: the coordinator draws one for each
``Pool`` player per group, and ``tandem eval`` plays the checkpoints it is given
as ``Local`` players. ``str(player)`` gives the config's form back (for records).

``cycle_roles`` is the training schedule (docs/architecture.md §4): group i plays the
config's ``environment.matchups[i % len]`` (or ``roles``), seats rotated when roles alternate.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_serializer


class _Player(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_serializer
    def _as_string(self) -> str:
        return str(self)


class AgentPlayer(_Player):
    """An agent of the config, played by its rollout's engines (and trained when it trains)."""

    kind: Literal["agent"] = "agent"
    agent: str = Field(min_length=1)

    def __str__(self) -> str:
        return self.agent


class Scripted(_Player):
    """One of the environment's scripted players (``Environment.scripted_players``), no model."""

    kind: Literal["scripted"] = "scripted"
    name: str = Field(min_length=1)

    def __str__(self) -> str:
        return f"scripted:{self.name}"


class Pool(_Player):
    """A past weight version of ``agent``, drawn per group from its last ``pool_size`` versions."""

    kind: Literal["pool"] = "pool"
    agent: str = Field(min_length=1)

    def __str__(self) -> str:
        return f"pool:{self.agent}"


class Local(_Player):
    """Fixed weights from an HF model directory, played in-process; samples like ``agent`` does.

    Never trained on. ``agent`` is the agent the weights belong to (a pool version's owner,
    the agent ``tandem eval`` scores)."""

    kind: Literal["local"] = "local"
    path: str = Field(min_length=1)
    agent: str = Field(min_length=1)

    def __str__(self) -> str:
        return f"local:{self.path}"


Player = Annotated[AgentPlayer | Scripted | Pool | Local, Field(discriminator="kind")]
PLAYER: TypeAdapter[AgentPlayer | Scripted | Pool | Local] = TypeAdapter(Player)  # a dumped player, read back
PLAYER_FORMS = "an agent name, 'scripted:<player>' or 'pool:<agent>'"


def parse_player(value: object) -> AgentPlayer | Scripted | Pool | Local:
    """A config string (or an already typed player) as a typed player; ValueError names the form."""
    if isinstance(value, AgentPlayer | Scripted | Pool | Local):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not {PLAYER_FORMS}")
    kind, sep, rest = value.partition(":")
    if not sep:
        kind, rest = "agent", value
    if not rest:
        raise ValueError(f"{value!r} is not {PLAYER_FORMS}")
    if kind == "agent":
        return AgentPlayer(agent=rest)
    if kind == "scripted":
        return Scripted(name=rest)
    if kind == "pool":
        return Pool(agent=rest)
    raise ValueError(f"{value!r} is not {PLAYER_FORMS}")


def agent_of(player: AgentPlayer | Scripted | Pool | Local) -> str | None:
    """The agent a player names (its own, a pool's owner, a local copy's), or None for a scripted one."""
    return None if isinstance(player, Scripted) else player.agent


def parse_role_map(mapping: object, field: str) -> dict[str, AgentPlayer | Scripted | Pool | Local]:
    """A config's role -> player map, typed; ValueError names ``field`` and the role at fault."""
    if not isinstance(mapping, dict):
        raise ValueError(f"{field}: {mapping!r} is not a role -> player map")
    out = {}
    for role, player in mapping.items():
        try:
            out[role] = parse_player(player)
        except ValueError:
            raise ValueError(f"{field}.{role}: {player!r} is not {PLAYER_FORMS}") from None
    return out


def cycle_roles(seats: list[str], maps: list[dict[str, Player]], alternate: bool, index: int) -> dict[str, Player]:
    """Group ``index``'s role -> player map: ``maps[index % len(maps)]``; with ``alternate`` its players move
    one seat (in ``seats`` order) each time the cycle comes back to it, so each map is played from every side."""
    base, turn = maps[index % len(maps)], index // len(maps)
    players = [base[r] for r in seats]
    if alternate:
        k = turn % len(players)
        players = players[k:] + players[:k]
    return dict(zip(seats, players, strict=True))
