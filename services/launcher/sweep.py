"""``tandem sweep CONFIG --seeds 0,1,2 [--set KEY=VALUE …] [--setup NAME:KEY=VALUE,KEY=VALUE …]``.

Runs one config over seeds and set-ups, each sub-run a real ``tandem up --fresh`` (docs/architecture.md
§1, the launcher) in its own child process, one after another, then writes one table and one plot
across them (services/launcher/sweep_report.py).

Every sub-run gets its own run name ``<sweep>.<setup>.s<seed>``, its directory under
``run.output_dir/<sweep>/`` and its checkpoints under ``run.checkpoint_root/<sweep>/``, so ``--fresh``
only ever wipes the sweep's own sub-runs. A seed sets ``run.seed`` (episode starts, pool draws) and
moves every agent's ``seed`` (torch) by ``1000 × seed``; seed 0 is the config as written. ``api.port``
is 0 (a free port). ``--set`` applies to every set-up, a set-up's own keys after it; a set-up may name
another base config with ``config=PATH``. Keys are dotted paths into the YAML, values YAML scalars;
every key is checked against the schema before anything runs, and a bad one fails naming it. A
sub-run whose ``summary.json`` says done, with the same sub-config, is kept (``--redo`` runs it again).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.contracts.config import ConfigError, parse_config, yaml_load
from services.launcher.processes import LOST_EPISODES
from services.launcher.sweep_report import SubRun, write_report

SETUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
KEY = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_:-]+)*$")
SEED_STRIDE = 1000


@dataclass
class Setup:
    name: str
    sets: list[tuple[str, Any]] = field(default_factory=list)
    config: str | None = None


def parse_assignment(text: str) -> tuple[str, Any]:
    """``a.b.c=value`` → (``a.b.c``, the value read as a YAML scalar: ``1e-3`` a float, ``false`` a bool)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not KEY.match(key):
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE with a dotted KEY (e.g. agents.A.algorithm.lr=1e-3)")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: {raw!r} is not a YAML value: {exc}") from None
    return key, value


def parse_setup(text: str) -> Setup:
    """``name:k=v,k=v`` (a comma starts a new pair only before ``key=``, so flow values keep theirs)."""
    name, _, rest = text.partition(":")
    if not SETUP_NAME.match(name):
        raise ConfigError(f"--setup {text!r}: the name must be letters, digits, _ or - (then :KEY=VALUE,…)")
    setup = Setup(name)
    for part in (p for p in re.split(r",(?=\s*[A-Za-z0-9_.:-]+=)", rest) if p.strip()):
        key, value = parse_assignment(part)
        if key == "config":
            setup.config = str(value)
        else:
            setup.sets.append((key, value))
    return setup


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected integers separated by commas, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"--seeds {text!r}: expected distinct non-negative integers, e.g. 0,1,2")
    return seeds


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted ``key`` in ``data``; a missing section is created, a non-section on the way is an error."""
    node: Any = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part) if isinstance(node, dict) else None
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = nxt
    node[parts[-1]] = copy.deepcopy(value)


def check_keys(base: dict[str, Any], pairs: list[tuple[str, Any]], source: str) -> None:
    """Apply every pair and validate; a key the schema does not know, or a value it rejects, fails naming it."""
    data = copy.deepcopy(base)
    for key, value in pairs:
        set_key(data, key, value)
    try:
        parse_config(data, source)
    except ConfigError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines()[1:]]
        for key, value in pairs:
            about = [ln for ln in lines if ln.split(":")[0] == key or ln.startswith(key + ".")
                     or key.startswith(ln.split(":")[0] + ".")]
            if about:
                raise ConfigError(f"--set {key}={value!r}: {'; '.join(about)}") from None
        given = ", ".join(k for k, _ in pairs) or "none"
        raise ConfigError(f"{source} with the keys set ({given}):\n  " + "\n  ".join(lines)) from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    data = yaml_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {p} must be a mapping at the top level")
    parse_config(copy.deepcopy(data), str(p))  # the base itself is valid
    return data


def sub_data(base: dict[str, Any], sets: list[tuple[str, Any]], sweep: str, setup: str, seed: int
             ) -> dict[str, Any]:
    """The config of one sub-run: ``sets`` applied, then the sweep's run name, directories, seeds and port."""
    data = copy.deepcopy(base)
    for key, value in sets:
        set_key(data, key, value)
    run = data.setdefault("run", {})
    run["name"] = f"{sweep}.{setup}.s{seed}"
    run["output_dir"] = str(Path(run.get("output_dir", "runs")) / sweep)
    run["checkpoint_root"] = str(Path(run.get("checkpoint_root", "checkpoints")) / sweep)
    run["seed"] = seed
    for agent in (data.get("agents") or {}).values():
        if isinstance(agent, dict):
            agent["seed"] = int(agent.get("seed", 0)) + SEED_STRIDE * seed
    data.setdefault("api", {})["port"] = 0
    return data


def plan(config: str, seeds: list[int], sets: list[tuple[str, Any]], setups: list[Setup], sweep: str
         ) -> list[SubRun]:
    """Every sub-run's config, each checked (all before any runs); a bad key fails naming it."""
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]*$", sweep):
        raise ConfigError(f"--name {sweep!r}: letters, digits, _ or - only")
    if len({s.name for s in setups}) != len(setups):
        raise ConfigError("--setup: two set-ups have the same name")
    out: list[SubRun] = []
    for setup in setups or [Setup("base")]:
        source = setup.config or config
        base = load_yaml(source)
        pairs = sets + setup.sets
        check_keys(base, pairs, source)
        out_dir = Path((base.get("run") or {}).get("output_dir", "runs")) / sweep / "configs"
        for seed in seeds:
            data = sub_data(base, pairs, sweep, setup.name, seed)
            cfg = parse_config(copy.deepcopy(data), f"{source} ({setup.name}, seed {seed})")
            if len(cfg.run.name) > 64:
                raise ConfigError(f"run name {cfg.run.name!r} is over 64 characters: shorten --name or the set-up")
            out.append(SubRun(setup.name, seed, cfg.run.name, out_dir / f"{cfg.run.name}.yaml", data, cfg))
    return out


def is_done(sub: SubRun, text: str) -> bool:
    """Its summary says done, no error, and it ran from exactly this sub-config."""
    summary = sub.run_dir / "summary.json"
    if not summary.is_file() or not sub.config_path.is_file() or sub.config_path.read_text() != text:
        return False
    try:
        data = json.loads(summary.read_text())
    except ValueError:
        return False
    return data.get("phase") == "done" and not data.get("error")


def run_sub(sub: SubRun, redo: bool) -> int:
    """``tandem up SUBCONFIG --fresh`` in a child process (its output to ``run_dir``'s sweep.log)."""
    text = yaml.safe_dump(sub.data, sort_keys=False)
    if not redo and is_done(sub, text):
        print(f"[sweep] {sub.name}: already done, kept", flush=True)
        return 0
    sub.config_path.parent.mkdir(parents=True, exist_ok=True)
    sub.config_path.write_text(text)
    log_path = sub.config_path.with_suffix(".log")
    print(f"[sweep] {sub.name}: tandem up {sub.config_path} --fresh (log {log_path})", flush=True)
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", str(sub.config_path), "--fresh"],
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: `tandem up` stops its services, then the sweep stops
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
            raise
    print(f"[sweep] {sub.name}: exit {proc.returncode}", flush=True)
    if proc.returncode == LOST_EPISODES:  # finished: its report counts what it lost (episodes_failed)
        print(f"[sweep] {sub.name}: finished with failed episodes (see its summary.json)", flush=True)
        return 0
    return proc.returncode


def add_sweep_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run a config over seeds and set-ups; one table (mean ± SE) and one plot")
    p.add_argument("config", help="the base config (YAML) every sub-run starts from")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted key into the YAML for every set-up, e.g. run.total_steps=6")
    p.add_argument("--setup", action="append", default=[], metavar="NAME:KEY=VALUE,…",
                   help="a named set-up (repeatable); config=PATH takes another base config")
    p.add_argument("--name", default=None, help="the sweep's name (default sweep-<run.name>)")
    p.add_argument("--redo", action="store_true", help="run sub-runs again even if they are done")
    p.add_argument("--report-only", action="store_true", help="only collect what is there and write the report")


def sweep_command(args: argparse.Namespace) -> int:
    """Plan (every key checked), run each sub-run in turn, write the report; 2 for a bad argument."""
    try:
        sets = [parse_assignment(s) for s in args.set]
        setups = [parse_setup(s) for s in args.setup]
        name = args.name or f"sweep-{load_yaml(args.config).get('run', {}).get('name', 'run')}"
        subs = plan(args.config, parse_seeds(args.seeds), sets, setups, name)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    failed = []
    if threading.current_thread() is threading.main_thread():  # SIGTERM stops the sweep like Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
    code = 0
    try:
        for i, s in enumerate([] if args.report_only else subs, 1):
            print(f"[sweep] {i}/{len(subs)}", flush=True)
            if run_sub(s, args.redo) != 0:
                failed.append(s.name)
    except KeyboardInterrupt:
        print("[sweep] interrupted: the report covers the sub-runs done so far (run the same command to go on)",
              file=sys.stderr)
        code = 130
    md, js, png = write_report(subs, Path(subs[0].cfg.run.output_dir), name)
    print(md.read_text())
    print(f"table: {md}\njson: {js}\nplot: {png}")
    if failed:
        print(f"[sweep] failed sub-runs: {', '.join(failed)}", file=sys.stderr)
    return code or (1 if failed else 0)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
