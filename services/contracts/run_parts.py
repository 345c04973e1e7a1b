"""Parts of the run's config outside the agents: checkpoint retention, the control API, experiment logging, and
the collect → SFT → RL pipeline (``tandem pipeline``).

Re-exported by ``services.contracts.config`` (the config's one import path)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.contracts.agent_parts import SftSchedule, Strict


class CheckpointRetention(Strict):
    """Which weight versions (``<checkpoint_root>/<run>/<agent>/v#####``) a trainer keeps on disk once a newer one
    is committed. Always kept besides: the versions the in-run evaluation plays (multiples of
    ``environment.eval.every_n_steps``), so the one an evaluation scored best is among them."""

    keep_last: int = Field(0, ge=0, description="keep the newest N weight versions; 0 keeps every version")
    keep_every: int = Field(0, ge=0, description="also keep every k-th version (k, 2k, ...); 0: no others")



class ApiConfig(Strict):
    host: str = Field("127.0.0.1", description="the control API's and dashboard's listen address")
    port: int = Field(8900, ge=0, le=65535, description="the control API's and dashboard's port; 0 = a free port")
    token: str = Field("",
                       description="a bearer token every route but /health, /metrics, the OpenAPI document and the "
                                   "dashboard page requires; empty = open")


class WandbConfig(Strict):
    """Weights & Biases: ``offline`` writes a run directory under runs/<run>/wandb (no network; sync it
    later with ``wandb sync``); ``online`` needs network and a login."""

    project: str = Field(min_length=1, description="the W&B project")
    mode: Literal["online", "offline", "disabled"] = Field("offline",
                                                           description="offline writes runs/<run>/wandb without "
                                                                       "network; online logs live; disabled writes "
                                                                       "nothing")
    entity: str | None = Field(None, description="the W&B entity (user or team); null: the login's default")


class LoggingConfig(Strict):
    """Experiment logging the coordinator writes from what it already receives."""

    tensorboard: bool = Field(True, description="TensorBoard event files under runs/<run>/tensorboard")
    wandb: WandbConfig | None = Field(None, description="Weights & Biases logging (needs tandem[wandb]); null: none")
    interval_s: float = Field(5.0, gt=0, description="how often new metrics are written")
    text_every: int = Field(25, ge=0, description="every Nth episode's transcript is logged as text (0: none)")


class PipelineSft(SftSchedule):
    """The pipeline's SFT stage: the schedule, and its own learning rate."""

    lr: float | None = Field(None, gt=0, description="the SFT stage's learning rate; null: the agent's algorithm.lr")


class PipelineConfig(Strict):
    """``tandem pipeline CONFIG``: collect (the training agents play with their ``model_path``), then SFT of each
    training agent on its own trajectories (algorithm sft), then RL (``tandem up``) from the SFT checkpoints."""

    episodes: int = Field(ge=1, description="collect: the episodes played")
    min_reward: float | None = Field(None, description="collect: keep only the trajectories with at least this reward")
    sft: PipelineSft = Field(default_factory=PipelineSft, description="the SFT stage's schedule and learning rate")
    demonstrate: list[str] = Field(default_factory=list, description="collect: roles played by the environment's "
                                   "demonstrations instead of their model (tandem collect --demonstrate): warm-up "
                                   "data for a protocol the start model does not follow, e.g. tool calls")
