"""Auth is on by default when ``tandem serve`` binds beyond loopback: with no ``api_keys`` a key is generated
once into ``data_dir/api_key`` (0600) and required; loopback stays open unless keys are set."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest
import tinker

from services.common.embedded_redis import EmbeddedRedis
from services.tinker_api.config import ServeConfig, ensure_auth
from tests.tinker_server import TinkerServer


def test_which_addresses_get_a_generated_key(tmp_path: Path):
    assert ensure_auth(ServeConfig(host="127.0.0.1", data_dir=tmp_path)) is None
    assert ensure_auth(ServeConfig(host="::1", data_dir=tmp_path)) is None
    assert ensure_auth(ServeConfig(host="0.0.0.0", data_dir=tmp_path, api_keys=["tml-mine"])) is None
    assert ensure_auth(ServeConfig(host="0.0.0.0", data_dir=tmp_path, open_beyond_loopback=True)) is None
    cfg = ServeConfig(host="0.0.0.0", data_dir=tmp_path)
    key_file = ensure_auth(cfg)
    assert key_file == tmp_path / "api_key" and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    again = ServeConfig(host="10.0.0.5", data_dir=tmp_path)
    ensure_auth(again)
    assert cfg.api_keys == again.api_keys == [key_file.read_text().strip()]  # made once, kept


def test_a_server_beyond_loopback_requires_its_generated_key(redis_server: EmbeddedRedis, tmp_path: Path):
    url = redis_server.url.rsplit("/", 1)[0] + "/12"
    srv = TinkerServer(url, tmp_path, settings={"host": "0.0.0.0"}).start()
    try:
        key = (tmp_path / "api_key").read_text().strip()
        body = {"tags": [], "sdk_version": "test"}
        assert httpx.post(srv.url + "/api/v1/create_session", json=body).status_code == 401
        with pytest.raises(tinker.AuthenticationError):
            tinker.RestClient(base_url=srv.url, api_key="tml-guess").list_training_runs().result()
        ok = httpx.post(srv.url + "/api/v1/create_session", json=body, headers={"X-API-Key": key})
        assert ok.status_code == 200 and ok.json()["session_id"]
    finally:
        srv.stop()
