"""Redis memory at a real config's shape (issue 33; the done-id plateau of docs/guides/recovery.md).

Runs ``tandem up CONFIG --fresh --set ...`` as a subprocess, exactly as a user would, against a Valkey this
script starts and owns (``TANDEM_REDIS_URL``, so the script can read it; the same server and settings as the
launcher's embedded one: ``run.redis_appendfsync``, ``run.redis_maxmemory_mb``). Every ``--every`` seconds
it samples ``INFO memory`` (``used_memory``, ``used_memory_peak``, ``used_memory_dataset``), the trained steps
(the slower agent's published version) and the done-id sets' ids (``ZCARD``), bytes (``MEMORY USAGE``) and the
messages handled (tests/bench/memory_run.py's ``done_ids``: each stream's entries ever added, once per consumer group).

The summary: steps/min and messages/s past ``--warmup-s``, bytes per id, the done-id sets' size over time,
how many seconds of messages they hold at the end, and the plateau the formula predicts (grace x the message
rate past grace + ``--lag-s`` x bytes per id) against the one measured (the mean over the samples past grace +
``--lag-s``), with the done-sets' slope there (flat or still growing).

    PYTHONPATH=$PWD python tests/bench/memory_demo.py configs/demo.yaml --set run.total_steps=900 \\
        --set environment.eval.episodes=0 --out build/memory_demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from services.common.embedded_redis import EmbeddedRedis  # noqa: E402
from services.contracts.config import TandemConfig  # noqa: E402
from services.launcher.overrides import load_with_overrides  # noqa: E402
from tests.bench.memory_run import done_ids, slope_mb_per_1000, trained_steps  # noqa: E402


def launch(args: argparse.Namespace, url: str, log: Path) -> subprocess.Popen[bytes]:
    """``tandem up`` on the config with the script's overrides, its output to ``log``."""
    cmd = [sys.executable, "-m", "services.launcher.cli", "up", args.config, "--fresh"]
    for item in run_sets(args):
        cmd += ["--set", item]
    env = {**os.environ, "TANDEM_REDIS_URL": url, "PYTHONPATH": str(REPO)}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def run_sets(args: argparse.Namespace) -> list[str]:
    """The run's name and output folders (under ``--dir``), then the caller's ``--set`` items."""
    return [
        f"run.name={args.run}",
        f"run.output_dir={args.dir / 'runs'}",
        f"run.checkpoint_root={args.dir / 'checkpoints'}",
        *args.set,
    ]


def run_config(args: argparse.Namespace) -> TandemConfig:
    """The config as ``tandem up`` will see it (for the Valkey settings and the grace)."""
    return load_with_overrides(args.config, run_sets(args))[0]


def sample(client: redis.Redis, run: str, started: float) -> dict[str, Any]:
    """One sample: seconds since the start, steps, Valkey's memory and the done-id sets."""
    mem = client.info("memory")
    return {
        "t": round(time.time() - started, 1),
        "step": trained_steps(client, run),
        "used_memory": int(mem["used_memory"]),
        "used_memory_peak": int(mem["used_memory_peak"]),
        "used_memory_dataset": int(mem["used_memory_dataset"]),
        **done_ids(client, run),
    }


def sample_run(args: argparse.Namespace, client: redis.Redis, proc: subprocess.Popen[bytes]) -> list[dict]:
    """Samples every ``--every`` s until the run ends (or ``--max-wall-s``: then it is stopped like Ctrl-C)."""
    started = time.time()
    samples: list[dict[str, Any]] = []
    while proc.poll() is None:
        if time.time() - started > args.max_wall_s:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
            break
        samples.append(sample(client, args.run, started))
        if args.verbose:
            print(json.dumps(samples[-1]), flush=True)
        time.sleep(max(0.0, args.every - (time.time() - started - samples[-1]["t"])))
    samples.append({**sample(client, args.run, started), "after_exit": True})
    return samples


def rate(samples: list[dict], key: str, since_s: float) -> float | None:
    """Least-squares slope of ``key`` per second over the samples at or past ``since_s``."""
    pts = [(s["t"], s[key]) for s in samples if s["t"] >= since_s and not s.get("after_exit")]
    slope, _ = slope_mb_per_1000(pts)
    return None if slope != slope else slope * 1e6 / 1000  # MB per 1,000 s back to units per second


def window_s(samples: list[dict]) -> float | None:
    """How many seconds of messages the done-id sets hold at the last live sample: its time minus the time when
    the messages handled were fewer by the ids now held (linear between samples; the grace plus the lags)."""
    live = [s for s in samples if not s.get("after_exit")]
    if not live:
        return None
    last = live[-1]
    floor = last["handled"] - last["ids"]
    for a, b in pairwise(live):
        if a["handled"] <= floor <= b["handled"] and b["handled"] > a["handled"]:
            return round(
                last["t"] - (a["t"] + (b["t"] - a["t"]) * (floor - a["handled"]) / (b["handled"] - a["handled"])), 1
            )
    return None


def plateau(samples: list[dict], since_s: float) -> dict[str, Any]:
    """The done-id sets past ``since_s``: mean, min, max of ids and bytes, and their slope (MB per 1,000 s)."""
    late = [s for s in samples if s["t"] >= since_s and not s.get("after_exit")]
    if len(late) < 3:
        return {"samples": len(late)}
    slope, se = slope_mb_per_1000([(s["t"], s["bytes"]) for s in late])
    return {
        "samples": len(late),
        "from_s": late[0]["t"],
        "to_s": late[-1]["t"],
        "ids_mean": round(sum(s["ids"] for s in late) / len(late)),
        "ids_min": min(s["ids"] for s in late),
        "ids_max": max(s["ids"] for s in late),
        "bytes_mean": round(sum(s["bytes"] for s in late) / len(late)),
        "bytes_min": min(s["bytes"] for s in late),
        "bytes_max": max(s["bytes"] for s in late),
        "bytes_mb_per_1000_s": round(slope, 3),
        "bytes_mb_per_1000_s_se": round(se, 3),
    }


def summarise(args: argparse.Namespace, samples: list[dict], grace: float, code: int | None) -> dict[str, Any]:
    """Steps/min, messages/s, bytes per id, the plateau measured and the one the formula predicts."""
    live = [s for s in samples if not s.get("after_exit")] or samples
    last, end = live[-1], samples[-1]
    msgs = rate(samples, "handled", args.warmup_s)
    steps = rate(samples, "step", args.warmup_s)
    per_id = last["bytes"] / last["ids"] if last["ids"] else None
    measured = plateau(samples, grace + args.lag_s)
    late = rate(samples, "handled", grace + args.lag_s)  # the rate the plateau's own window saw
    predicted = grace * late * per_id if late and per_id else None
    return {
        "config": args.config,
        "sets": run_sets(args),
        "exit_code": code,
        "grace_s": grace,
        "wall_s": last["t"],
        "steps_done": end["step"],
        "steps_per_min_overall": round(end["step"] / last["t"] * 60, 1) if last["t"] else None,
        "steps_per_min_past_warmup": round(steps * 60, 1) if steps else None,
        "messages_per_s_past_warmup": round(msgs, 1) if msgs else None,
        "messages_per_s_past_grace": round(late, 1) if late else None,
        "messages_handled": end["handled"],
        "done_sets_hold_last_s": window_s(samples),
        "bytes_per_id_last": round(per_id, 1) if per_id else None,
        "used_memory_mb_peak_sampled": round(max(s["used_memory"] for s in samples) / 1e6, 2),
        "used_memory_mb_peak_valkey": round(end["used_memory_peak"] / 1e6, 2),
        "used_memory_mb_last_live": round(last["used_memory"] / 1e6, 2),
        "used_memory_mb_after_exit": round(end["used_memory"] / 1e6, 2),
        "done_ids_max": max(s["ids"] for s in samples),
        "done_bytes_mb_max": round(max(s["bytes"] for s in samples) / 1e6, 2),
        "plateau_measured": measured,
        "plateau_predicted_bytes": round(predicted) if predicted else None,
        "plateau_predicted_ids": round(grace * late) if late else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as `tandem up --set`")
    p.add_argument("--run", default="memory-demo", help="run.name")
    p.add_argument("--dir", type=Path, default=REPO / "build" / "memory_demo", help="runs/, checkpoints/, redis/")
    p.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--warmup-s", type=float, default=120.0, help="seconds left out of the rates")
    p.add_argument("--lag-s", type=float, default=60.0, help="past the grace: the trim and prune lags")
    p.add_argument("--max-wall-s", type=float, default=3600.0, help="stop the run (SIGINT) after this long")
    p.add_argument("--verbose", action="store_true", help="print each sample")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.dir = args.dir.resolve()
    cfg = run_config(args)
    server = EmbeddedRedis(
        data_dir=args.dir / "redis", appendfsync=cfg.run.redis_appendfsync, maxmemory_mb=cfg.run.redis_maxmemory_mb
    ).start(timeout=120)
    client = redis.Redis.from_url(server.url)
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        proc = launch(args, server.url, args.dir / "up.log")
        samples = sample_run(args, client, proc)
        result = {**summarise(args, samples, cfg.run.done_ids_grace_s, proc.poll()), "samples": samples}
    finally:
        client.close()
        server.stop()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
