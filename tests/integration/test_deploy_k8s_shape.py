"""The rendered Kubernetes manifests keep their invariants, checked on the objects of every kustomization a user
applies (the overlays and tinker-api): every container has resource limits, every service container probes;
no secret reaches an environment value (they are mounted files); every claim names the storage class
parameter; the run is finite (Jobs; only Redis runs on); images come from the one ``images:`` block; only
Tandem's pods reach Redis and the API; the trainers keep a bounded number of weight versions."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from urllib.parse import urlparse

import pytest
import yaml

from tests.deploy_inventory import REPO, strictly_valid, tool

KUSTOMIZATIONS = ("overlays/cpu", "overlays/gpu", "overlays/cpu-shared-base", "tinker-api")
K8S = REPO / "deploy" / "k8s"
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|API_KEYS", re.I)


@cache
def render(path: str) -> list[dict]:
    res = subprocess.run([tool("kubectl"), "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=120)
    return strictly_valid(res)[0]


def pod_specs(docs: list[dict]) -> list[tuple[dict, dict]]:
    return [(d, d["spec"]["template"]["spec"]) for d in docs if d["kind"] in ("Job", "Deployment", "StatefulSet")]


def storage_class_param(path: str) -> str:
    top = path.split("/")[0] if path.startswith("tinker") else path
    return yaml.safe_load((K8S / top / "storage-class.yaml").read_text())["data"]["storageClassName"]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_container_has_limits_and_every_service_probes(path):
    for doc, spec in pod_specs(render(path)):
        one_shot = doc["kind"] == "Job" and spec["restartPolicy"] == "OnFailure"  # model init: runs to its end
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{path}: {doc['metadata']['name']}/{c['name']}"
            limits = c.get("resources", {}).get("limits", {})
            assert limits.get("cpu") and limits.get("memory"), f"{where}: no cpu and memory limits"
            assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False, where
            if c not in spec.get("initContainers", []) and not one_shot:
                assert "livenessProbe" in c and "readinessProbe" in c, f"{where}: no probes"


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_secrets_are_mounted_files_never_environment_values_or_urls(path):
    docs = render(path)
    assert not [d for d in docs if d["kind"] == "Secret"], "no Secret is committed"
    for doc, spec in pod_specs(docs):
        secret_volumes = {v["name"] for v in spec.get("volumes", []) if "secret" in v}
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{path}: {doc['metadata']['name']}/{c['name']}"
            mounted = {m["mountPath"]: m for m in c.get("volumeMounts", []) if m["name"] in secret_volumes}
            assert all(m.get("readOnly") for m in mounted.values()), f"{where}: a secret mounted writable"
            for e in c.get("env", []):
                assert "secretKeyRef" not in e.get("valueFrom", {}), f"{where}: {e['name']} from a Secret into env"
                value = str(e.get("value", ""))
                assert "://" not in value or not urlparse(value).password, f"{where}: {e['name']} holds a password"
                if SECRET_NAME.search(e["name"]):
                    assert e["name"].endswith("_FILE") and any(value.startswith(p + "/") for p in mounted), \
                        f"{where}: {e['name']} is not a mounted secret file"
            assert not c.get("envFrom") or all("secretRef" not in f for f in c["envFrom"]), where
    for v in (v for _, spec in pod_specs(docs) for v in spec.get("volumes", []) if "secret" in v):
        assert v["secret"]["defaultMode"] == 0o440, v


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_claim_names_the_storage_class_parameter(path):
    docs = render(path)
    param = storage_class_param(path)
    claims = [d["spec"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
    claims += [t["spec"] for d in docs if d["kind"] == "StatefulSet" for t in d["spec"].get("volumeClaimTemplates", [])]
    assert claims and all(c["storageClassName"] == param for c in claims), [c.get("storageClassName") for c in claims]
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("tandem-storage")]


@pytest.mark.parametrize("path", ["overlays/cpu", "overlays/gpu", "overlays/cpu-shared-base"])
def test_the_run_is_finite_and_bounded(path):
    docs = render(path)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")}
    assert {k for k in kinds if k[0] != "Job"} == {("StatefulSet", "redis")}
    assert ("Job", "coordinator") in kinds and ("Job", "model-init" if "gpu" in path else "init-model") in kinds
    env = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("tandem-env"))["data"]
    assert int(env["TANDEM__run__checkpoint_retention__keep_last"]) >= 2  # weight versions kept on disk
    model = "/models/Qwen3-1.7B" if "gpu" in path else "/models/demo-ttt"
    for doc, spec in pod_specs(docs):  # nothing that reads the model starts before the model Job wrote it
        if doc["metadata"].get("labels", {}).get("tandem.dev/needs-model") == "true":
            wait = " ".join(spec["initContainers"][0]["command"])
            assert f"{model}/.ready" in wait, doc["metadata"]["name"]
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "redis"}


@pytest.mark.parametrize("path", ["overlays/cpu", "overlays/gpu", "overlays/cpu-shared-base"])
def test_only_tandem_pods_reach_redis_and_the_api(path):
    policies = {d["metadata"]["name"]: d["spec"] for d in render(path) if d["kind"] == "NetworkPolicy"}
    for name, target, port in (("redis", "redis", 6379), ("tandem-api", "coordinator", 8900)):
        spec = policies[name]
        assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": target}
        rule = next(r for r in spec["ingress"] if {"port": port, "protocol": "TCP"} in r["ports"])
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "tandem"}}}]


def test_images_come_from_the_one_images_block():
    block = yaml.safe_load((K8S / "components" / "settings" / "kustomization.yaml").read_text())["images"]
    wanted = {i["name"]: i for i in block}
    files = [p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"]
    for p in files:  # the manifests name images without a tag: the block alone sets them
        for image in re.findall(r"^\s*image: (\S+)", p.read_text(), re.M):
            assert image in wanted, f"{p}: image {image} is not in the images block (or carries its own tag)"
    for path in KUSTOMIZATIONS:
        for _, spec in pod_specs(render(path)):
            for c in spec.get("initContainers", []) + spec["containers"]:
                name, _, rest = c["image"].partition(":")
                entry = wanted[name]
                assert rest == entry["newTag"] + (f"@{entry['digest']}" if "digest" in entry else ""), c["image"]
