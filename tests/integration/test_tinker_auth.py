"""Auth is on by default when ``tandem serve`` binds beyond loopback: with no ``api_keys`` a key is generated
once into ``data_dir/api_key`` (0600) and required; loopback stays open unless keys are set. The SDK trades
its key for a JWT the server signs, which ``RestClient.whoami`` reads (one principal per key)."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import httpx
import pytest
import tinker

from services.common.embedded_redis import EmbeddedRedis
from services.tinker_api import identity
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
        rest = tinker.RestClient(base_url=srv.url, api_key=key)
        me = rest.whoami().result()  # the claims of the JWT the SDK got for the key
        assert me.user_urn == "tml:user:key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        assert me.org_urn == "tml:organization:local" and me.email is None
        assert isinstance(rest.list_training_runs().result().training_runs, list)  # requests carry the JWT
        forged = identity.mint(b"not-this-servers-secret", me.user_urn)
        denied = httpx.post(srv.url + "/api/v1/create_session", json=body, headers={"X-API-Key": forged})
        assert denied.status_code == 401 and 'error="invalid_token"' in denied.headers["www-authenticate"]
    finally:
        srv.stop()


def test_jwts_are_checked_for_signature_and_expiry(tmp_path: Path):
    secret = identity.load_secret(tmp_path)
    assert identity.load_secret(tmp_path) == secret and stat.S_IMODE((tmp_path / "jwt_secret").stat().st_mode) == 0o600
    token = identity.mint(secret, "tml:user:local", now=1000.0)
    claims = identity.verify(secret, token, now=1000.0 + identity.LIFETIME_S - 1)
    assert claims is not None and claims.sub == "tml:user:local" and claims.org_id == "local"
    assert identity.verify(secret, token, now=1000.0 + identity.LIFETIME_S) is None  # expired
    assert identity.verify(b"other", token, now=1000.0) is None
    head, body, sig = token.split(".")
    assert identity.verify(secret, f"{head}.{body}x.{sig}", now=1000.0) is None
    assert identity.principal("tml-a", keyed=False) == "tml:user:local"
    assert identity.principal("tml-a", keyed=True) != identity.principal("tml-b", keyed=True)
