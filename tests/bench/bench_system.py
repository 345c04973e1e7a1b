"""System benchmarks: the whole topology (``tandem up``) against the in-process loop, start-up, async.

docs/architecture.md §1 (topology), §4 (sync and staleness), §9 (one laptop). Three figures:

- ``step_time_ratio_vs_in_process`` (goal <= 2.0): seconds per training step of ``configs/demo.yaml``
  run through every service (``tandem up``) over seconds per step of the same algorithm,
  hyper-parameters, group layout and episode path in one process (``tests/bench/rl_sweep.py``:
  services/play's episode loop, in-process engines, ``TorchPolicy``): the demo's matchups (half its games
  against scripted players) and KL term, and as many groups a step as give each agent its
  ``groups_per_batch`` (16 with the demo's four matchups, each agent in two). A system step is both agents'
  next version: per step k, the later of the two agents' ``TrainStep`` times (``metrics.json``); the
  figure is the mean interval from step 1 to the last, so start-up and the first step's warm-up are
  out. The in-process figure is the median of its steps after the first (its per-step log).
- ``first_turn_s`` (goal 6 s, warm machine): seconds from launching ``tandem up`` to the first
  engine reply on the run's reply stream (the bench gives the run its own embedded Redis and polls
  ``XLEN`` every 50 ms). The median over the system runs below (the first run warms the page cache).
- ``async.step_rate_ratio``: training steps per second (the same interval measure) of the demo with
  both agents at ``max_staleness: 1`` over both at 0. Above 1 means asynchrony pays.

The demo config is used as written except: ``total_steps`` = ``BENCH_SYSTEM_STEPS`` (default 4),
no held-out evaluation (``eval.episodes: 0``; it is not part of a step), its own ports, Redis and
directories. Arms run one after another (system demo, in-process, staleness 1, staleness 0; one
round each: every arm is minutes of a busy 2-core box), so ``load_average`` before and after is
part of the result. ``BENCH_SYSTEM_ASYNC=0`` skips the two staleness runs.

    PYTHONPATH=. python tests/bench/bench_system.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.common.embedded_redis import EmbeddedRedis, free_port  # noqa: E402
from services.contracts.streams import Streams  # noqa: E402
from tests.helpers import launch_up  # noqa: E402

STEPS = int(os.environ.get("BENCH_SYSTEM_STEPS", "4"))
ASYNC = os.environ.get("BENCH_SYSTEM_ASYNC", "1") == "1"
RUN_TIMEOUT_S = float(os.environ.get("BENCH_SYSTEM_TIMEOUT_S", "900"))
DEMO = ROOT / "configs" / "demo.yaml"
# The demo once per device (its engines and trainers there, "cpu,cuda" on a GPU box); the first is the headline.
DEVICES = os.environ.get("BENCH_SYSTEM_DEVICES", "cpu").split(",")


def model_dir(tmp: Path) -> Path:
    """``models/demo-ttt`` when ``tandem init-demo`` made it, else the tests' cached warm-started model."""
    demo = ROOT / "models" / "demo-ttt"
    if (demo / "config.json").is_file():
        return demo
    from tests.conftest import copy_warm_model

    return copy_warm_model(ROOT / "build" / "test-cache", tmp / "model")


def demo_config(tmp: Path, model: Path, name: str, redis_url: str, staleness: int | None,
                device: str = "cpu", source: Path = DEMO, steps: int = STEPS) -> Path:
    """``source`` (the demo) shortened to ``steps`` with no evaluation, on ``model``, with its own ports and dirs."""
    cfg = yaml.safe_load(source.read_text())
    cfg["run"].update(name=name, total_steps=steps, checkpoint_root=str(tmp / "ckpt"),
                      output_dir=str(tmp / "runs"), trim_interval_s=0)
    cfg["redis_url"] = redis_url
    cfg["api"]["port"] = free_port()
    cfg["environment"]["eval"]["episodes"] = 0
    for agent in cfg["agents"].values():
        agent["model_path"] = str(model)
        if device != "cpu":
            agent["embedded"] = {"device": device}
            agent["trainer"] = {"device": device}
        if staleness is not None:
            agent["max_staleness"] = staleness
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def step_seconds(step_times: list[float]) -> float:
    """Mean seconds per step from the first step's time to the last's."""
    if len(step_times) < 2:
        raise RuntimeError(f"need at least 2 training steps to time, got {len(step_times)}")
    return (step_times[-1] - step_times[0]) / (len(step_times) - 1)


def system_step_times(metrics: dict[str, Any]) -> list[float]:
    """Per version k, the later of the agents' ``TrainStep`` times (both agents have version k)."""
    per_agent = [[s["time"] for s in sorted(a["train_steps"], key=lambda s: s["weight_version"])]
                 for a in metrics.values()]
    return [max(ts) for ts in zip(*per_agent, strict=False)]


def run_up(tmp: Path, model: Path, name: str, staleness: int | None, device: str = "cpu", source: Path = DEMO,
           steps: int = STEPS, timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """One ``tandem up`` of the demo config (or ``source``): first-turn seconds, seconds per step, wall seconds."""
    work = tmp / name
    work.mkdir()
    with EmbeddedRedis(data_dir=work / "redis-ext") as server:
        client = redis.Redis.from_url(server.url)
        cfg = demo_config(work, model, name, server.url, staleness, device, source, steps)
        with open(work / "launcher.log", "wb") as log:
            started = time.monotonic()
            proc = launch_up(cfg, stdout=log)
            first_turn = None
            replies = Streams(name).replies("coordinator")  # (a pattern would match its done set too)
            try:
                while proc.poll() is None and time.monotonic() - started < timeout_s:
                    if first_turn is None and client.xlen(replies):
                        first_turn = time.monotonic() - started
                    time.sleep(0.05)
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(60)
        client.close()
    if proc.returncode != 0:
        tail = (work / "launcher.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"tandem up ({name}) exited {proc.returncode}:\n{tail}")
    metrics = json.loads((work / "runs" / name / "metrics.json").read_text())
    times = system_step_times(metrics)
    return {"first_turn_s": round(first_turn, 2) if first_turn is not None else None,
            "step_s": round(step_seconds(times), 3), "steps": len(times),
            "wall_s": round(time.monotonic() - started, 1)}


def in_process_step_s(model: Path) -> float:
    """rl_sweep with the demo's hyper-parameters, matchups (scripted opponents) and KL term: the median step time
    after the first."""
    from tests.bench import rl_sweep

    demo = yaml.safe_load(DEMO.read_text())
    a = demo["agents"]["A"]
    algo = a["algorithm"]
    matchups = demo["environment"].get("matchups", [])
    # a system step trains each agent on groups_per_batch groups: with matchups, only those A plays in count for A
    share = sum("A" in m.values() for m in matchups) / len(matchups) if matchups else 1.0
    args = argparse.Namespace(model=str(model), steps=STEPS, G=demo["environment"]["group_size"],
                              groups=round(a["groups_per_batch"] / share), lr=algo["lr"], clip=algo["clip_eps_low"],
                              clip_high=algo["clip_eps_high"], epochs=algo["epochs"],
                              minibatches=algo["minibatches"], max_grad_norm=1.0, no_std=False, opening_moves=0,
                              eval_games=2, eval_every=10**6, eval_temps=["1"],
                              matchups=[",".join(f"{role}={who}" for role, who in m.items())
                                        for m in demo["environment"].get("matchups", [])],
                              kl_coef=algo.get("kl_coef", 0.0), entropy_coef=algo.get("entropy_coef", 0.0),
                              temperature=a["sampling"].get("temperature", 1.0))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        asyncio.run(rl_sweep.run(args, seed=0))
    steps = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith('{"step"')]
    times = [s["seconds"] for s in steps if "seconds" in s]
    return statistics.median(times[1:] if len(times) > 1 else times)


def run() -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-system-") as tmp_name:
        tmp = Path(tmp_name)
        model = model_dir(tmp)
        demo = run_up(tmp, model, "bench-demo", None, DEVICES[0])
        in_proc = in_process_step_s(model)
        runs = {"demo": demo}
        by_device = {d: run_up(tmp, model, f"bench-{d}", None, d) for d in DEVICES[1:]}
        if ASYNC:
            runs["staleness1"] = run_up(tmp, model, "bench-s1", 1)
            runs["staleness0"] = run_up(tmp, model, "bench-s0", 0)
    first_turns = [r["first_turn_s"] for r in runs.values() if r["first_turn_s"] is not None]
    out: dict[str, Any] = {
        "system": {"step_time_ratio_vs_in_process": round(demo["step_s"] / in_proc, 2),
                   "system_step_s": demo["step_s"], "in_process_step_s": round(in_proc, 3), "steps": STEPS,
                   "device": DEVICES[0], "by_device": by_device, "runs": runs,
                   "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                   "seconds": round(time.perf_counter() - started, 1)},
        "startup": {"first_turn_s": round(statistics.median(first_turns), 2) if first_turns else None,
                    "first_turn_s_per_run": first_turns},
    }
    if ASYNC:
        out["async"] = {"step_rate_ratio": round(runs["staleness0"]["step_s"] / runs["staleness1"]["step_s"], 3),
                        "staleness1_step_s": runs["staleness1"]["step_s"],
                        "staleness0_step_s": runs["staleness0"]["step_s"]}
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
