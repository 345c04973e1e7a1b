"""Experiment configuration (docs/architecture.md §7): one YAML file, validated at start.

Every service reads the same file. Environment variables override single fields: ``TANDEM_REDIS_URL``,
``TANDEM_RUN_NAME``, and ``TANDEM__a__b__c=value`` for any field (``TANDEM__agents__A__max_staleness=1``);
``TANDEM_REDIS_PASSWORD_FILE`` puts the password in that file (a mounted secret) into the Redis URL, and
``TANDEM_API_TOKEN_FILE`` the control API's token in that file into ``api.token``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit, urlunsplit

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from services.contracts.agent_parts import (  # noqa: F401 (re-exported: the config's one import path)
    BUILTIN_ALGORITHMS,
    PLUGIN_PATH,
    AlgorithmConfig,
    DeviceConfig,
    EmbeddedConfig,
    LoraConfig,
    MegatronLayout,
    SftDataConfig,
    SftRecord,
    SGLangEngineConfig,
    Strict,
    TrainerConfig,
)
from services.contracts.env_parts import (  # noqa: F401 (re-exported: the config's one import path)
    DatasetConfig,
    EnvironmentConfig,
    EvalConfig,
    Opponent,
)
from services.contracts.messages import SamplingParams
from services.contracts.players import AgentPlayer, Pool
from services.contracts.run_parts import (  # noqa: F401 (re-exported: the config's one import path)
    ApiConfig,
    CheckpointRetention,
    LoggingConfig,
    PipelineConfig,
    WandbConfig,
)
from services.contracts.sharing import sharing_problem
from services.contracts.yaml_text import yaml_load


class ConfigError(ValueError):
    """A config that cannot run; the message names the field."""


class AgentConfig(Strict):
    model_path: str = Field(description="the agent's start model: a local Hugging Face model directory (config.json, "
                                        "weights, tokenizer)")
    backend: Literal["torch", "megatron"] = Field("torch", description="the trainer's backend: torch (transformers "
                                                  "+ AdamW) or megatron (megatron-core; needs tandem[megatron])")
    engine: Literal["embedded", "sglang"] = Field("embedded", description="the inference engine behind the agent's "
                                                  "SGLang router: embedded (Tandem's CPU/GPU engine) or sglang (SGLang "
                                                  "servers on GPUs)")
    num_engines: int = Field(1, ge=1, description="inference engines the agent's rollout starts behind its router")
    max_inflight_per_engine: int = Field(64, ge=1, description="generation requests the rollout keeps in flight "
                                         "per healthy engine; the rest wait on the turns stream")
    router_port: int = Field(0, ge=0, le=65535, description="the rollout's SGLang router; 0 = a free port")
    share_engines_with: str | None = Field(None, description="run this agent's turns on the named agent's engine "
                                           "fleet (one base, each agent's own LoRA adapters; same model_path and "
                                           "engine, both with lora); this agent's engine fields are then unused")
    engine_base_port: int = Field(0, ge=0, le=65535, description="engine i listens on base+i; 0 = free ports")
    sglang: SGLangEngineConfig = Field(default_factory=SGLangEngineConfig, description="engine: sglang: the "
                                       "launch_server arguments of each engine")
    embedded: EmbeddedConfig = Field(default_factory=EmbeddedConfig,
                                     description="the embedded engine's device, dtype and prefix cache")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig,
                                   description="the trainer's device, precision and activation checkpointing")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig,
                                       description="the training algorithm and its hyper-parameters")
    sft: SftDataConfig | None = Field(None, description="algorithm sft: train on a chat-format JSONL file "
                                      "(tandem sft), tokenized with the agent's chat template")
    groups_per_batch: int = Field(4, ge=1, description="GRPO groups per training batch (one training step)")
    max_staleness: int = Field(0, ge=0, description="how many weight versions generation may run ahead of the "
                               "loaded weights (0: on-policy)")
    filter_zero_variance: bool = Field(False, description="drop groups whose rewards are all equal")
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="sampling parameters of the "
                                     "agent's training episodes (SGLang's names)")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters on a frozen base instead of every weight "
                                    "(torch backend; SFT from a file merges them into its checkpoint); null: full "
                                    "fine-tuning")
    seed: int = Field(0, description="the agent's torch seed (initialisation of any new parameters, dropout, data "
                      "order)")
    megatron: MegatronLayout = Field(default_factory=MegatronLayout,
                                     description="backend: megatron: the parallel layout (TP x PP x DP)")
    train: bool = Field(True, description="false: a frozen agent — its engine serves fixed weights, no trainer")
    max_nonfinite_steps: int = Field(3, ge=1, description="the trainer stops after this many training steps in a "
                                     "row skipped for a non-finite loss, gradient or weight")
    max_no_signal_steps: int = Field(10, ge=0, description="the run stops (an error, a non-zero exit) after this "
                                     "many training steps in a row with no learning signal: every group of the "
                                     "batch had equal rewards (zero variance), so every advantage was 0; the first "
                                     "such step is warned of; 0: never stop")

    @field_validator("sampling", mode="before")
    @classmethod
    def _strict_sampling(cls, v: Any) -> Any:
        """SamplingParams is a wire model (lax there for now); in a config it is as strict as the rest."""
        if isinstance(v, dict):
            bad = [k for k, x in v.items() if isinstance(x, float) and not math.isfinite(x)]
            if bad:
                raise ValueError(f"{bad[0]}: must be a finite number")
            return SamplingParams.model_validate(v, strict=True)
        return v

    @model_validator(mode="after")
    def _ports_fit(self) -> AgentConfig:
        if self.engine_base_port and self.engine_base_port + self.num_engines - 1 > 65535:
            raise ValueError(f"engine_base_port {self.engine_base_port} + num_engines {self.num_engines} "
                             "runs past port 65535")
        return self

    @model_validator(mode="after")
    def _torch_only_parts(self) -> AgentConfig:
        used = {"lora": self.lora is not None, "algorithm.baseline: 'value'": self.algorithm.baseline == "value",
                "trainer.micro_batch_size": bool(self.trainer.micro_batch_size)}
        for part in (k for k, on in used.items() if on and self.backend != "torch"):
            raise ValueError(f"{part} needs backend 'torch' (backend is {self.backend!r})")
        if self.sft is not None and (self.algorithm.name != "sft" or self.backend != "torch"):
            raise ValueError(f"sft: a dataset trains with algorithm sft on backend torch (algorithm.name is "
                             f"{self.algorithm.name!r}, backend {self.backend!r})")
        return self


class RunConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=64,
                      description="the run's name: its directory runs/<name>, checkpoints/<name> and Redis keys "
                                  "tandem:<name>:*")
    seed: int = Field(0, description="the run's seed: episode starts, scripted players and pool draws")
    total_steps: int = Field(10, ge=1, description="training steps (weight versions) per agent")
    concurrent_episodes: int = Field(16, ge=1, description=(
        "episodes the coordinator plays at once (across groups and agents); while another training agent has "
        "groups to play, each keeps within its share, ceil(concurrent_episodes / training agents) "
        "(docs/architecture.md §4)"))
    checkpoint_root: str = Field("checkpoints",
                                 description="where each agent's weight versions and trainer states go: "
                                             "<checkpoint_root>/<run>/<agent>/")
    output_dir: str = Field("runs",
                            description="where the run's directory (report, logs, embedded Redis data, TensorBoard) "
                                        "goes: <output_dir>/<run>/")
    trim_interval_s: float = Field(30.0, ge=0, description="trim acknowledged stream entries every N seconds; "
                                   "0 keeps every entry (audits, tests)")
    group_timeout_s: float = Field(600.0, gt=0, description="a GRPO group not complete this many seconds after "
                                   "it was launched (while playing) or emitted (in the buffer) is abandoned, "
                                   "so a lost turn or a dead-lettered sample never stalls the run")
    max_restarts: int = Field(5, ge=0, description="tandem up: restarts of one service (Redis included) allowed "
                              "within restart_window_s before the run stops; 0 = a dying service stops the run")
    restart_window_s: float = Field(600.0, gt=0, description="the sliding window max_restarts counts in")
    redis_appendfsync: Literal["everysec", "always"] = Field(
        "always", description="embedded Redis AOF fsync: always writes and fsyncs before it replies, so no "
        "acknowledged write is lost (a full disk stops Redis, and the run, naming the disk); everysec is faster per "
        "write, waits out a full disk, but loses up to ~2 s of acknowledged writes on a Redis crash while the disk "
        "is busy and ~1 s on a machine crash (docs/guides/recovery.md)")
    redis_maxmemory_mb: int = Field(4096, ge=0, description="embedded Redis maxmemory (noeviction: a full Redis "
                                    "refuses writes and the run stops naming the limit); 0 = no limit")
    done_ids_grace_s: float = Field(600.0, ge=10, description="how long every service waits out an unreachable "
                                    "or full Redis (then it gives up), and so how long past the stream's retained "
                                    "entries a consumer group keeps the ids it handled: the done-id sets level off "
                                    "at about grace x messages per second x 80-95 bytes (docs/guides/recovery.md)")
    transcripts_kept: int = Field(1000, ge=1, description="episode transcripts kept in Redis per purpose (train, "
                                  "eval); older ones are archived to runs/<run>/transcripts.jsonl.gz")
    state_kept_steps: int = Field(50, ge=4, description="per-step state kept in Redis, in training steps: the "
                                  "trainer's log records (and their trained-sample ids) beyond the newest N are "
                                  "archived to <checkpoint_root>/<run>/<agent>/train_log.jsonl; resolved groups "
                                  "more than N + max_staleness versions old leave the group ledger and the "
                                  "buffer's verdicts for runs/<run>/ledger.<agent>.jsonl (at least max_staleness "
                                  "+ 4 are kept)")
    checkpoint_retention: CheckpointRetention = Field(
        default_factory=CheckpointRetention,
        description="weight versions the trainer keeps on disk: the newest keep_last, every keep_every-th; every "
                    "evaluated version is always kept")


class TandemConfig(Strict):
    run: RunConfig = Field(description="the run: its name, length, seeds, directories, restarts and retention")
    redis_url: str = Field("", description="an external Redis/Valkey (redis://[:password@]host:port/db); empty: "
                           "tandem up starts an embedded one")
    api: ApiConfig = Field(default_factory=ApiConfig, description="the coordinator's control API and dashboard")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="TensorBoard and W&B logging")
    environment: EnvironmentConfig = Field(description="the environment, who plays each role, and the evaluation")
    pipeline: PipelineConfig | None = Field(None, description="tandem pipeline: collect, then SFT, then RL")
    agents: dict[str, AgentConfig] = Field(min_length=1, description="the agents by name, each with its own model, "
                                           "engines, trainer and algorithm")

    @field_validator("agents")
    @classmethod
    def _agent_names(cls, v: dict[str, AgentConfig]) -> dict[str, AgentConfig]:
        for name in v:
            if not re.match(r"^[A-Za-z0-9_-]+$", name):
                raise ValueError(f"agent name {name!r} may hold only letters, digits, _ and -")
        return v

    @model_validator(mode="after")
    def _roles_name_agents(self) -> TandemConfig:
        env = self.environment
        for field, mapping in [("environment.roles", env.roles), *env.training_maps()[:len(env.matchups)]]:
            if set(mapping) != set(env.roles):  # a matchup names every role of roles (checked against the env)
                raise ValueError(f"{field}: names roles {sorted(mapping)}, not {sorted(env.roles)} (environment.roles)")
            for role, player in mapping.items():
                if isinstance(player, AgentPlayer | Pool) and player.agent not in self.agents:
                    raise ValueError(f"{field}.{role} names agent {player.agent!r}, "
                                     f"which is not under agents ({', '.join(self.agents)})")
        if not any(a.train for a in self.agents.values()):
            raise ValueError("agents: every agent has train: false; at least one must train")
        playing: set[str] = set()  # each map needs a training agent; each training agent a seat in some map
        for field, mapping in env.training_maps():
            agents = {p.agent for p in mapping.values() if isinstance(p, AgentPlayer)}
            if not any(self.agents[a].train for a in agents):
                raise ValueError(f"{field}: no role is played by an agent that trains")
            playing |= agents
        if idle := [n for n, a in self.agents.items() if a.train and n not in playing]:
            raise ValueError(f"agents.{idle[0]}: trains but plays no role under environment."
                             f"{'matchups' if env.matchups else 'roles'} (set train: false or give it a role)")
        if (shared := sharing_problem(self.agents)) is not None:
            raise ValueError(shared)
        self._retention_keeps_what_is_read()
        return self

    def _retention_keeps_what_is_read(self) -> None:
        """Pruned versions must be ones nothing loads any more: not the one the rollouts hold while the next is
        published, nor one a pool player draws from."""
        keep = self.run.checkpoint_retention.keep_last
        pooled = any(isinstance(p, Pool) for _, m in self.environment.training_maps() for p in m.values())
        floor = max(2, self.environment.pool_size if pooled else 0)
        if keep and keep < floor:
            raise ValueError(f"run.checkpoint_retention.keep_last: {keep} is below {floor}, the versions a rollout "
                             "or a pool player may still load (0 keeps every version)")

    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def _set_path(data: dict[str, Any], path: list[str], value: str) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part} is not a section")
    node[path[-1]] = yaml_load(value) if value != "" else ""


def read_secret(variable: str, path: str) -> str:
    """The non-empty secret in the file ``path`` (a mounted secret) that ``$variable`` names."""
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{variable}: cannot read {path}: {exc.strerror}") from None
    if not secret:
        raise ConfigError(f"{variable}: {path} is empty")
    return secret


def with_password(url: str, password_file: str) -> str:
    """``url`` with the password read from ``password_file`` (a mounted secret), URL-quoted."""
    try:
        password = Path(password_file).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"TANDEM_REDIS_PASSWORD_FILE: cannot read {password_file}: {exc.strerror}") from None
    parts = urlsplit(url)
    if not password or not parts.hostname:
        raise ConfigError(f"TANDEM_REDIS_PASSWORD_FILE: {password_file} is empty or redis_url has no host")
    netloc = f"{quote(parts.username or '', safe='')}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def apply_env_overrides(data: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, Any]:
    env = os.environ if environ is None else environ
    if "TANDEM_REDIS_URL" in env:
        data["redis_url"] = env["TANDEM_REDIS_URL"]
    if env.get("TANDEM_REDIS_PASSWORD_FILE") and data.get("redis_url"):
        data["redis_url"] = with_password(str(data["redis_url"]), env["TANDEM_REDIS_PASSWORD_FILE"])
    if env.get("TANDEM_API_TOKEN_FILE"):
        data.setdefault("api", {})["token"] = read_secret("TANDEM_API_TOKEN_FILE", env["TANDEM_API_TOKEN_FILE"])
    if "TANDEM_RUN_NAME" in env:
        data.setdefault("run", {})["name"] = env["TANDEM_RUN_NAME"]
    for key, value in env.items():
        if key.startswith("TANDEM__"):
            _set_path(data, key[len("TANDEM__"):].split("__"), value)
    return data


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {field}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<dict>") -> TandemConfig:
    try:
        return TandemConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_config(path: str | Path, environ: dict[str, str] | None = None) -> TandemConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {p} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {p} must be a mapping at the top level")
    return parse_config(apply_env_overrides(data, environ), str(p))
