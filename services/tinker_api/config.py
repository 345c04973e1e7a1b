"""``tandem serve``'s configuration: a YAML file with a ``tinker_api:`` section, or none (the defaults).

Unknown keys fail at start, naming the field. With no ``redis_url`` the service starts its
own embedded Redis, which persists under ``data_dir/redis`` so futures survive a restart.
API keys may also come from ``TANDEM_TINKER_API_KEYS`` (comma-separated) or the file
``TANDEM_TINKER_API_KEYS_FILE`` names (a mounted secret; one key a line or comma-separated), and the Redis URL
from ``TANDEM_REDIS_URL`` when the file names none (as in the compose and Kubernetes files).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.contracts.config import ConfigError, read_secret, with_password


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8910, ge=0, le=65535)
    redis_url: str | None = Field(None, description="an external Redis; None = an embedded one")
    data_dir: Path = Field(Path("runs/tinker"), description="checkpoints, sampler snapshots, embedded Redis")
    api_keys: list[str] = Field(default_factory=list, description="accepted X-API-Key values; empty = open on "
                                                                  "loopback, a generated key beyond it")
    jwt_auth: bool = Field(True, description="the SDK trades its key for a JWT minted here (/api/v1/auth/token), "
                                             "which RestClient.whoami reads; off = plain API keys")
    open_beyond_loopback: bool = Field(False, description="serve a non-loopback address without API keys")
    base_models: list[str] = Field(default_factory=list, description="listed in capabilities (any local "
                                                                      "model directory is served)")
    models: dict[str, Path] = Field(default_factory=dict, description="hub names served from local model "
                                                                      "directories (NAME: DIR)")
    sampler_cache: int = Field(4, ge=1, description="engines (weights snapshots) kept loaded, LRU")
    session_idle_s: float = Field(300.0, gt=0, description="a session without a heartbeat or a training request this "
                                                          "long is finished "
                                                          "(the SDK sends one every 10 s)")
    sampler_idle_s: float = Field(600.0, gt=0, description="an ephemeral sampler snapshot unused this long is "
                                                          "deleted (each model's newest is kept)")
    reap_every_s: float = Field(30.0, gt=0, description="how often idle sessions and snapshots are looked for")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="the trainer's device; auto = cuda if present")

    @field_validator("models")
    @classmethod
    def _model_dirs(cls, models: dict[str, Path]) -> dict[str, Path]:
        for name, path in models.items():
            if not (Path(path) / "config.json").is_file():
                raise ValueError(f"{name}: {path} is not a local model directory (no config.json)")
        return {name: Path(path).resolve() for name, path in models.items()}

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigFileError("tinker_api.device: cuda was asked for, but torch sees no GPU")
        return self.device


class ConfigFileError(ValueError):
    pass


def load_serve_config(path: str | None) -> ServeConfig:
    raw: dict = {}
    if path:
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigFileError(f"{path}: {exc}") from None
        raw = doc.get("tinker_api", doc) if isinstance(doc, dict) else {}
        if not isinstance(raw, dict):
            raise ConfigFileError(f"{path}: tinker_api must be a mapping")
    try:
        cfg = ServeConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigFileError(f"{path}: tinker_api.{where}: {first['msg']}") from None
    listed = os.environ.get("TANDEM_TINKER_API_KEYS", "")
    if os.environ.get("TANDEM_TINKER_API_KEYS_FILE"):  # a mounted secret (compose, Kubernetes)
        try:
            listed += "," + read_secret("TANDEM_TINKER_API_KEYS_FILE", os.environ["TANDEM_TINKER_API_KEYS_FILE"])
        except ConfigError as exc:
            raise ConfigFileError(str(exc)) from None
    env_keys = [k.strip() for k in listed.replace("\n", ",").split(",") if k.strip()]
    if env_keys:
        cfg.api_keys = [*cfg.api_keys, *env_keys]
    if cfg.redis_url is None and os.environ.get("TANDEM_REDIS_URL"):
        cfg.redis_url = os.environ["TANDEM_REDIS_URL"]
    if cfg.redis_url and os.environ.get("TANDEM_REDIS_PASSWORD_FILE"):  # a mounted secret (compose, Kubernetes)
        try:
            cfg.redis_url = with_password(cfg.redis_url, os.environ["TANDEM_REDIS_PASSWORD_FILE"])
        except ConfigError as exc:
            raise ConfigFileError(str(exc)) from None
    return cfg


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ensure_auth(cfg: ServeConfig) -> Path | None:
    """Auth is on by default beyond loopback: with no ``api_keys`` there, one key is generated once into
    ``data_dir/api_key`` (0600) and required; returns that file (None when nothing was needed)."""
    if cfg.api_keys or is_loopback(cfg.host) or cfg.open_beyond_loopback:
        return None
    key_file = cfg.data_dir / "api_key"
    if not key_file.is_file():
        key_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("tml-" + secrets.token_urlsafe(24) + "\n")
    cfg.api_keys = [key_file.read_text().strip()]
    return key_file
