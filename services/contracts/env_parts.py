"""The ``environment`` section of the config: the environment, who plays each role, its dataset, the evaluation.

``EnvironmentConfig.env_params`` is what every service makes the environment with: ``params``, with a
top-level ``dataset`` (``DatasetConfig``, the same spec as ``params.dataset``) put under ``params.dataset``; the
dataset's files are read when the environment checks its parameters at start (services/envs/datasets.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from services.contracts.agent_parts import PLUGIN_PATH, Strict
from services.contracts.players import Player, Scripted, cycle_roles, parse_role_map


class DatasetConfig(Strict):
    """Where an environment's tasks come from instead of its generator: a local file or directory (nothing is
    fetched), its splits and the columns of the task's fields (docs/guides/datasets.md)."""

    path: str = Field(description="a local .jsonl, .json or .parquet file ({split} in it: the split's name), or "
                      "a directory saved by Hugging Face datasets")
    split: str = Field("train", min_length=1, description="the split training draws tasks from")
    eval_split: str | None = Field(None, description="the held-out split evaluations draw from; unset: `split`")
    split_column: str | None = Field(None, description="a single file's column naming each row's split")
    fields: dict[str, str] = Field(default_factory=dict, description="task field -> the dataset's column "
                                   "(math: question, answer; code: prompt, tests); unset fields keep their name")


Opponent = str | dict[str, str]


class EvalConfig(Strict):
    """Held-out evaluation against the env's scripted players (docs/architecture.md §8): at the start and end
    of the run, every ``every_n_steps`` training steps, and by ``tandem eval``. ``opponent`` (one) and
    ``opponents`` (several) are both accepted; ``opponents()`` is the list either way."""

    episodes: int = Field(64, ge=0, description="episodes per agent and opponent")
    opponent: Opponent = Field("random", description="the env's scripted player for the other roles, or one "
                               "per role ({role: player})")
    opponents: list[Opponent] = Field(default_factory=list, description="several opponents, each reported on "
                                      "its own (the first is the headline score: eval_start/eval_end)")
    every_n_steps: int = Field(0, ge=0, description="also evaluate each agent's checkpoint of every n-th "
                               "weight version during the run (0: only at start and end)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of the evaluation episodes (0: greedy)")

    @model_validator(mode="after")
    def _one_list(self) -> EvalConfig:
        if self.opponents and "opponent" in self.model_fields_set:
            raise ValueError("give either opponent or opponents, not both")
        return self

    def opponent_list(self) -> list[Opponent]:
        """Every opponent, the headline first."""
        return list(self.opponents) or [self.opponent]


class EnvironmentConfig(Strict):
    name: str = Field(description="a registered environment (`tandem envs` lists them) or a plug-in as "
                                  "package.module:Class")
    params: dict[str, Any] = Field(default_factory=dict,
                                   description="the environment's parameters, checked against its Params model "
                                               "(`tandem envs` shows them)")
    dataset: DatasetConfig | None = Field(None, description="draw the tasks from a local dataset (JSONL, JSON, "
                                          "Parquet or a Hugging Face datasets directory; fields, splits, a held-out "
                                          "eval_split) instead of the environment's generator: math, math_critic, "
                                          "code, code_critic and tool_math take one (the same as params.dataset)")
    group_size: int = Field(8, ge=1, description="episodes per group (a sample's Sample.group_samples is its "
                            "agent's share: its samples in the whole group)")
    roles: dict[str, Player] = Field(description="environment role -> player: an agent name, "
                                     "'scripted:<player>' (the env's scripted player) or 'pool:<agent>' "
                                     "(a past weight version of that agent, played in the coordinator)")
    alternate_roles: bool = Field(False, description="rotate the role->player map every group (each matchup's)")
    matchups: list[dict[str, Player]] = Field(default_factory=list, description="training opponent mix: role -> "
                                              "player maps, group i plays matchups[i % len] (empty: roles); "
                                              "each names every role and a training agent; eval uses roles")
    pool_size: int = Field(4, ge=1, description="'pool:<agent>' draws from that agent's last pool_size versions")
    scripted_rng: Literal["episode", "group"] = Field(
        "episode", description="a training group's scripted players draw from one random stream per episode, or "
        "per group (every copy restarts it from a seed derived from the group's: copies that play alike get the "
        "same replies, so the group's baseline compares the agents' moves, not the opponent's luck)")
    eval: EvalConfig = Field(default_factory=EvalConfig,
                             description="the held-out evaluation: opponents, episodes, how often")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if ":" in v and not PLUGIN_PATH.match(v):
            raise ValueError(f"{v!r} is not a plug-in path of the form package.module:Class")
        return v

    @field_validator("roles", mode="before")
    @classmethod
    def _players(cls, v: Any) -> Any:
        """The YAML's player strings, parsed once into typed players (services/contracts/players.py)."""
        return parse_role_map(v, "environment.roles") if isinstance(v, dict) else v

    @field_validator("matchups", mode="before")
    @classmethod
    def _matchup_players(cls, v: Any) -> Any:  # like roles'; an error names environment.matchups[i].ROLE
        return [parse_role_map(m, f"environment.matchups[{i}]") for i, m in enumerate(v)] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _one_dataset(self) -> EnvironmentConfig:
        if self.dataset is not None and "dataset" in self.params:
            raise ValueError("dataset: also given as params.dataset; give it once (environment.dataset)")
        return self

    def env_params(self) -> dict[str, Any]:
        """The parameters the environment is made with: ``params``, with ``dataset`` as ``params.dataset``."""
        if self.dataset is None:
            return self.params
        return {**self.params, "dataset": self.dataset.model_dump(exclude_none=True)}

    def training_maps(self) -> list[tuple[str, dict[str, Player]]]:
        """The maps training groups play (matchups, else roles), each with its config field."""
        return [(f"environment.matchups[{i}]", m) for i, m in enumerate(self.matchups)] or [("environment.roles",
                                                                                              self.roles)]

    def group_roles(self, index: int) -> dict[str, Player]:
        """Group ``index``'s map (players.py ``cycle_roles``): a restart derives the same for the same index."""
        return cycle_roles(list(self.roles), [m for _, m in self.training_maps()], self.alternate_roles, index)

    def scripted(self) -> dict[str, Scripted]:
        """The roles the config gives a scripted player (they keep it in evaluation: a rule-based judge)."""
        return {r: p for r, p in self.roles.items() if isinstance(p, Scripted)}
