"""Secrets reach the services as mounted files (compose volumes, Kubernetes Secrets): the variables that name
them (``TANDEM_API_TOKEN_FILE``, ``TANDEM_TINKER_API_KEYS_FILE``, ``TANDEM_ADMIN_TOKEN_FILE``) are read at
start, and a missing or empty file fails the start naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.admin_token import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, token_from_env
from services.contracts.config import ConfigError, apply_env_overrides, parse_config
from services.tinker_api.config import ConfigFileError, load_serve_config


def config(environ: dict[str, str]):  # type: ignore[no-untyped-def]
    data = {"run": {"name": "r"}, "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
            "agents": {"A": {"model_path": "m"}}}
    return parse_config(apply_env_overrides(data, environ))


def test_the_api_token_comes_from_its_file(tmp_path: Path):
    token = tmp_path / "api-token"
    token.write_text("s3cret\n")
    assert config({"TANDEM_API_TOKEN_FILE": str(token)}).api.token == "s3cret"
    token.write_text("")
    with pytest.raises(ConfigError, match=r"TANDEM_API_TOKEN_FILE: .*api-token is empty"):
        config({"TANDEM_API_TOKEN_FILE": str(token)})
    with pytest.raises(ConfigError, match=r"TANDEM_API_TOKEN_FILE: cannot read .*nothing"):
        config({"TANDEM_API_TOKEN_FILE": str(tmp_path / "nothing")})


def test_the_tinker_api_keys_come_from_their_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    keys = tmp_path / "keys"
    keys.write_text("tml-a,tml-b\ntml-c\n")
    monkeypatch.delenv("TANDEM_TINKER_API_KEYS", raising=False)
    monkeypatch.setenv("TANDEM_TINKER_API_KEYS_FILE", str(keys))
    assert load_serve_config(None).api_keys == ["tml-a", "tml-b", "tml-c"]
    monkeypatch.setenv("TANDEM_TINKER_API_KEYS_FILE", str(tmp_path / "nothing"))
    with pytest.raises(ConfigFileError, match="TANDEM_TINKER_API_KEYS_FILE: cannot read"):
        load_serve_config(None)


def test_the_admin_token_comes_from_its_value_or_its_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.delenv(ADMIN_TOKEN_FILE_ENV, raising=False)
    assert token_from_env() is None  # the rollout then makes one
    token = tmp_path / "admin-token"
    token.write_text("abc123\n")
    monkeypatch.setenv(ADMIN_TOKEN_FILE_ENV, str(token))
    assert token_from_env() == "abc123"  # two rollouts on one fleet mount the same file
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "given")
    assert token_from_env() == "given"  # what a rollout hands its own engines and router
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    token.write_text("  \n")
    with pytest.raises(ConfigError, match=r"TANDEM_ADMIN_TOKEN_FILE: .*admin-token is empty"):
        token_from_env()
    monkeypatch.setenv(ADMIN_TOKEN_FILE_ENV, str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match=r"TANDEM_ADMIN_TOKEN_FILE: cannot read .*nothing"):
        token_from_env()
