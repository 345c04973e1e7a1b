"""Deployment secrets (docs/architecture.md §10, §11): Redis is never reachable without its password, and the
weights-signing secret reaches only the trainers and rollouts, never Redis."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.deploy_inventory import Container, compose, containers, k8s, mounts, topologies

# ---- Redis is never reachable without its password ----------------------------------------------------------------

def _redis_password_source(c: Container) -> str:
    """Where a Tandem container's Redis password comes from: its URL, or the file it names (mounted)."""
    url = urlparse(c.env["TANDEM_REDIS_URL"])
    assert url.scheme == "redis", c.where
    if url.password:
        return "url"
    path = c.env.get("TANDEM_REDIS_PASSWORD_FILE", "")
    assert path and str(Path(path).parent) in mounts(c), f"{c.where}: Redis URL without a password"
    return path


@pytest.mark.parametrize("kind,name", topologies())
def test_redis_needs_its_password_and_is_not_published(kind, name):
    cs = containers(kind, name)
    redis = [c for c in cs if "redis-server" in " ".join(c.command)]
    assert len(redis) == 1 and re.match(r"redis:\d+\.\d+\.\d+", redis[0].image)
    assert "requirepass" in " ".join(redis[0].command)
    if kind == "compose":
        assert not redis[0].extra["service"].get("ports"), "Redis must not be published"
    else:
        docs = k8s(name)[1]
        assert not [d for d in docs if d["kind"] == "Secret"], "no Secret is committed; the README says how to make it"
        svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "redis")
        assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
        assert not [d for d in docs if d["kind"] == "Service" and d["spec"].get("type") in ("NodePort", "LoadBalancer")
                    and d["spec"]["selector"] == svc["spec"]["selector"]]
    for c in cs:
        if "TANDEM_REDIS_URL" in c.env:
            source = _redis_password_source(c)
            assert source != "url", f"{c.where}: the Redis password is in a URL"
            # the file Redis itself reads its password from, on the same volume (compose) or Secret (k8s)
            assert _secret_source(c, "/secret") == _secret_source(redis[0], "/secret"), c.where


def _secret_source(c: Container, target: str) -> object:
    """What is mounted read-only at ``target``: compose's volume name, or Kubernetes's Secret (name, key)."""
    if c.where.startswith("compose"):
        vol = next(v for v in c.extra["service"]["volumes"] if v["target"] == target)
        assert vol["type"] == "volume" and vol.get("read_only"), c.where
        return vol["source"]
    mount = next(m for m in c.extra["container"]["volumeMounts"] if m["mountPath"] == target)
    assert mount.get("readOnly"), c.where
    vol = next(v for v in c.extra["doc"]["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    return vol["secret"]["secretName"], tuple(i["key"] for i in vol["secret"]["items"])


@pytest.mark.parametrize("kind,name", topologies())
def test_only_trainers_and_rollouts_get_the_weights_secret(kind, name):
    """The weights-signing secret is never in Redis (services/common/weights_auth.py): the trainers (which sign)
    and the rollouts (which verify) get it by environment or a mounted file; no other container has it."""
    for c in containers(kind, name):
        if c.where.endswith("/secrets"):  # compose's init container that writes the secrets
            assert mounts(c).get("/weights") is True
            continue
        given = {"TANDEM_WEIGHTS_SECRET", "TANDEM_WEIGHTS_SECRET_FILE"} & set(c.env)
        signs = c.module in ("services.trainer", "services.rollout")
        assert bool(given) == signs and (signs or "/weights" not in mounts(c)), c.where
        if "TANDEM_WEIGHTS_SECRET_FILE" in c.env:
            assert mounts(c).get(str(Path(c.env["TANDEM_WEIGHTS_SECRET_FILE"]).parent)) is False, c.where


SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|API_KEYS|token$", re.I)


@pytest.mark.parametrize("kind,name", topologies())
def test_no_secret_in_an_environment_value_or_a_url(kind, name):
    """Passwords, tokens and keys reach a container only as files it mounts (``*_FILE`` names the file):
    never as an environment value (``docker inspect`` and ``kubectl describe`` show those), never in a URL."""
    for c in containers(kind, name):
        for key, value in c.env.items():
            if SECRET_NAME.search(key):
                assert key.endswith("_FILE") and str(Path(value).parent) in mounts(c), f"{c.where}: {key} in env"
            assert not urlparse(value).password if "://" in value else True, f"{c.where}: {key} holds a password"
        if kind == "k8s":
            for e in c.extra["container"].get("env", []):
                assert "secretKeyRef" not in e.get("valueFrom", {}), f"{c.where}: {e['name']} from a Secret into env"


def test_compose_secret_files_are_0600_and_generated_when_not_given():
    rendered = compose("cpu")[1]["services"]
    init = rendered["secrets"]
    script = " ".join(init["command"]).replace("$$", "$")
    assert "umask 077" in script and "chmod 0600" in script and "/dev/urandom" in script
    assert not init.get("environment"), "given secrets come from files in ./secrets, never the environment"
    given = next(v for v in init["volumes"] if v["target"] == "/given")
    assert given["type"] == "bind" and given["read_only"]
    for name in ("redis-password", "weights-secret", "api-token", "tinker-api-keys"):
        assert f" {name} " in script, f"{name}: not written by the secrets service"
