"""Where ``tandem up`` spends its start-up: every launcher output line stamped with its arrival time.

docs/architecture.md §9 (one laptop). Runs ``tandem up`` of ``configs/demo.yaml`` (``--steps`` training
steps, no evaluation, the model ``--model``) from the tree ``--root`` (default: this repository; pass
an old copy to compare) against an external embedded Redis, and prints, in seconds from the launch:
the first output line of each process, the lines that mark a phase (engine model load, router and
engines up, the coordinator's wait for engines), the first reply on a ``replies`` stream (the first
turn, as ``tests/bench/bench_system.py`` times it) and the first ``TrainStep`` (``weights`` stream).
``--trace`` also writes every stamped line to a file. Measure old and new trees alternately:

    python tests/bench/startup_phases.py --root /tmp/old --model models/demo-ttt --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.common.embedded_redis import EmbeddedRedis, free_port  # noqa: E402

PROBE = Path(__file__).resolve().parent / "startup_probe"  # its sitecustomize stamps every process

# (phase, the text a launcher output line contains): the first line containing it marks the phase
MARKERS = [
    ("rollout.A first line", "rollout.A │"),
    ("coordinator first line", "coordinator │"),
    ("trainer.A first line", "trainer.A │"),
    ("buffer.A first line", "buffer.A │"),
    ("router+engines up (A)", "rollout.A │ "),
    ("coordinator waits for engines", "waiting for the engines"),
    ("all services up (launcher)", "all services up"),
]


def config(tmp: Path, root: Path, model: Path, redis_url: str, steps: int) -> Path:
    cfg = yaml.safe_load((root / "configs" / "demo.yaml").read_text())
    cfg["run"].update(name="startup", total_steps=steps, checkpoint_root=str(tmp / "ckpt"),
                      output_dir=str(tmp / "runs"))
    cfg["redis_url"] = redis_url
    cfg["api"]["port"] = free_port()
    cfg["environment"]["eval"]["episodes"] = 0
    for agent in cfg["agents"].values():
        agent["model_path"] = str(model)
    path = tmp / "startup.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def label(cmd: list[str]) -> str:
    """A process's name from its command line: launcher, rollout.A, engine.A-0, router, trainer.B..."""
    if "-m" not in cmd:
        return " ".join(cmd[:2])
    module = cmd[cmd.index("-m") + 1]
    if "--engine-id" in cmd:
        return f"engine.{cmd[cmd.index('--engine-id') + 1]}"
    if module.startswith("sglang_router") or module == "services.common.sglang_router_main":
        return "router"
    name = module.removeprefix("services.").split(".")[0]
    return f"{name}.{cmd[cmd.index('--agent') + 1]}" if "--agent" in cmd else name


def probe_events(probe: Path, wall0: float) -> list[tuple[float, str, str]]:
    """Every probe line as (seconds from the launch, process, event and detail), in time order."""
    out = []
    for f in probe.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            out.append((round(e["t"] - wall0, 2), label(e["cmd"]), f"{e['event']} {e['detail']}".strip()))
    return sorted(out)


def phases(events: list[tuple[float, str, str]]) -> dict[str, float]:
    """Per process: its start, its first torch import and its first connect (imports done)."""
    out: dict[str, float] = {}
    for t, who, what in events:
        key = f"{who}: " + ("start" if what == "start" else "torch" if what == "import torch"
                            else "connected" if what.startswith("first connect") else "")
        if not key.endswith(": ") and key not in out:
            out[key] = t
    return out


def streamed(client: redis.Redis, pattern: str) -> bool:
    """Whether a stream matching ``pattern`` has an entry (other keys under the pattern are skipped)."""
    return any(client.type(k) == b"stream" and client.xlen(k) for k in client.scan_iter(pattern))


def one_run(root: Path, model: Path, steps: int, trace: Path | None) -> dict[str, Any]:
    """One ``tandem up``: seconds from the launch to each marker, the first turn and the first train step."""
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(data_dir=Path(d) / "redis") as server:
        tmp = Path(d)
        client = redis.Redis.from_url(server.url)
        cfg = config(tmp, root, model, server.url, steps)
        probe = tmp / "probe"
        probe.mkdir()
        path = os.pathsep.join(x for x in (str(PROBE), str(root), os.environ.get("PYTHONPATH", "")) if x)
        env = {**os.environ, "PYTHONPATH": path, "TANDEM_STARTUP_PROBE": str(probe)}
        lines: list[tuple[float, str]] = []
        wall0, started = time.time(), time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", str(cfg)], cwd=root, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append((time.monotonic() - started, line.rstrip()))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        first_turn = first_step = None
        while proc.poll() is None and time.monotonic() - started < 600:
            now = time.monotonic() - started
            if first_turn is None and streamed(client, "tandem:startup:replies:*"):
                first_turn = now
            if first_step is None and streamed(client, "tandem:startup:weights:*"):
                first_step = now
            if first_step is not None:
                break
            time.sleep(0.02)
        proc.terminate()
        proc.wait(60)
        reader.join(5)
        client.close()
        events = probe_events(probe, wall0)
    if trace is not None:
        with open(trace, "a") as f:
            f.write(f"--- {root}\n" + "".join(f"{t:8.2f} {s}\n" for t, s in lines))
            f.write("".join(f"{t:8.2f} [{who}] {what}\n" for t, who, what in events))
    marks = {name: next((round(t, 2) for t, s in lines if text in s), None) for name, text in MARKERS}
    return {**marks, **phases(events), "first_turn_s": None if first_turn is None else round(first_turn, 2),
            "first_train_step_s": None if first_step is None else round(first_step, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", action="append", type=Path, help="tree(s) to run, alternated (default: this one)")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "demo-ttt")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--trace", type=Path, default=None)
    args = p.parse_args()
    roots = args.root or [ROOT]
    results: dict[str, list[dict[str, Any]]] = {str(r): [] for r in roots}
    for i in range(args.rounds):
        for r in roots:
            res = one_run(r, args.model.resolve(), args.steps, args.trace)
            res["load"] = os.getloadavg()[0]
            results[str(r)].append(res)
            print(json.dumps({"round": i, "root": str(r), **res}), flush=True)
    for r, runs in results.items():
        turns = [x["first_turn_s"] for x in runs if x["first_turn_s"] is not None]
        print(f"{r}: first turn median {statistics.median(turns) if turns else None} s over {len(turns)} run(s)")


if __name__ == "__main__":
    main()
