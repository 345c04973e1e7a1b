"""Deployment files and the recovery story: a bare ``docker compose up`` runs the whole CPU topology
(the GPU one is ``--profile gpu``), Redis always has a password (generated when none is given), and
what restarts a dead service and keeps its state matches README "Recovery" (compose restart policies,
Kubernetes restart policies, probes and strategies, Redis's AOF on a volume)."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy_inventory import compose, k8s, run_compose

PROFILES = ("gpu", "cpu")
OVERLAYS = ("cpu", "gpu", "cpu-shared-base")
SERVICES = {"services.coordinator", "services.rollout", "services.buffer", "services.trainer"}
SHARED = {"redis", "secrets"}  # in every compose topology


def test_a_bare_compose_up_runs_the_whole_cpu_topology_and_gpu_is_one_flag_away():
    bare = run_compose("config", "--services")
    assert bare.returncode == 0 and not bare.stderr.strip(), bare.stderr
    cpu = set(run_compose("--profile", "cpu", "config", "--services").stdout.split())
    gpu = set(run_compose("--profile", "gpu", "config", "--services").stdout.split())
    assert set(bare.stdout.split()) == cpu and cpu & gpu == SHARED
    services = {c.module for c in compose("cpu")[0] if c.module}
    assert services == SERVICES  # coordinator, and per agent rollout, buffer, trainer


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_runs_without_a_redis_password_given_and_redis_still_requires_one(profile):
    """No password given: one is generated into the volume redis-secret (kept); a file ./secrets/redis-password
    wins. Redis reads it on its standard input, so it is in no argv and no environment."""
    res = run_compose("--profile", profile, "config", password=None)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    services = yaml.safe_load(res.stdout)["services"]
    script = " ".join(services["secrets"]["command"]).replace("$$", "$")  # the rendered file keeps compose's $$
    assert "/dev/urandom" in script and "[ ! -s $1/$2 ]" in script and "[ -s /given/$2 ]" in script
    redis = " ".join(services["redis"]["command"]).replace("$$", "$")
    assert "redis-server -" in redis and "requirepass $(cat /secret/redis-password)" in redis
    assert "--requirepass" not in redis
    assert services["redis"]["depends_on"]["secrets"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_limits_every_container_and_rotates_its_logs(profile):
    services = compose(profile)[1]["services"]
    for name, svc in services.items():
        assert svc["logging"]["driver"] == "json-file" and svc["logging"]["options"]["max-file"], name
        if name != "secrets":
            assert svc.get("mem_limit") and svc.get("cpus"), f"{name}: no resource limits"
    redis = " ".join(services["redis"]["command"])
    maxmemory = int(redis.split("--maxmemory ")[1].split("mb")[0]) * 2**20
    assert "--maxmemory-policy noeviction" in redis and maxmemory < int(services["redis"]["mem_limit"])


@pytest.mark.parametrize("profile", PROFILES)
def test_nothing_that_reads_the_model_starts_before_it_is_written(profile):
    services = compose(profile)[1]["services"]
    if "init-model" not in services:
        return
    for c in compose(profile)[0]:
        if c.module:
            dep = c.extra["service"]["depends_on"].get("init-model")
            assert dep and dep["condition"] == "service_completed_successfully", f"{c.where} may start first"


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_restarts_crashed_services_and_keeps_redis_on_its_aof(profile):
    services = compose(profile)[1]["services"]
    for c in compose(profile)[0]:
        svc = c.extra["service"]
        if c.module:  # a crash (non-zero exit) restarts it; the exit 0 of a finished run does not
            assert svc["restart"] == "on-failure", f"{c.where}: restart {svc.get('restart')}"
    redis = services["redis"]
    assert redis["restart"] == "unless-stopped" and "--appendonly yes" in " ".join(redis["command"])
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])
    for one_shot in ("secrets", "init-model"):
        if one_shot in services:
            assert services[one_shot]["restart"] == "no"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_runs_a_finite_run_as_jobs_and_keeps_redis_on_its_aof(overlay):
    """Every Tandem service is a Job: exit 0 (the run is done) completes it, a crash makes a new pod (up to the
    backoff limit), exit 2 (bad config; the coordinator's 3: the run failed for good) fails it at once, and an
    eviction is not counted. Only Redis is a long-running workload."""
    docs = k8s(overlay)[1]
    assert {d["kind"] for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")} == {"StatefulSet"}
    for c in k8s(overlay)[0]:
        doc = c.extra["doc"]
        if not c.module or c.extra["init"]:
            continue
        assert doc["kind"] == "Job" and doc["spec"]["template"]["spec"]["restartPolicy"] == "Never", c.where
        rules = doc["spec"]["podFailurePolicy"]["rules"]
        fail = next(r for r in rules if r["action"] == "FailJob")["onExitCodes"]
        assert fail["operator"] == "In" and 2 in fail["values"], c.where
        assert (3 in fail["values"]) == (c.module == "services.coordinator"), c.where
        assert any(r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget" for r in rules)
        assert doc["spec"]["backoffLimit"] >= 3
        assert "livenessProbe" in c.extra["container"], f"{c.where}: a hung service is never restarted"
    redis = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert "--appendonly yes" in " ".join(container["command"])
    claim = redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert {"name": claim, "mountPath": "/data"} in container["volumeMounts"]
