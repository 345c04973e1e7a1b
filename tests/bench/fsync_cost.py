"""The cost of the embedded Redis's AOF fsync policy: ``everysec`` vs ``always``, side by side.

Two measurements, the arms alternated so that the machine's load falls on both alike:

* the demo, shortened (``--steps`` training steps, ``--groups`` groups per batch, ``--eval`` evaluation
  episodes), through ``tandem up --fresh`` with ``run.redis_appendfsync`` set per arm: the launcher's
  wall time and the run's own ``wall_s`` from ``summary.json``;
* Redis alone: ``--writes`` sequential XADD + SADD round trips (the pattern of a publish and an
  idempotency mark) against an embedded Valkey with each policy.

    python tests/bench/fsync_cost.py --model models/demo-ttt --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from services.common.embedded_redis import EmbeddedRedis  # noqa: E402

ARMS = ("everysec", "always")


def demo_run(arm: str, model: str, work: Path, steps: int, groups: int, episodes: int) -> dict[str, float]:
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data["run"].update(name=f"fsync-{arm}", total_steps=steps, checkpoint_root=str(work / "ckpt"),
                       output_dir=str(work / "runs"), redis_appendfsync=arm)
    data["api"]["port"] = 0
    data["environment"]["eval"]["episodes"] = episodes
    for agent in data["agents"].values():
        agent.update(model_path=model, groups_per_batch=groups)
    path = work / f"{arm}.yaml"
    path.write_text(yaml.safe_dump(data))
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "services.launcher.cli", "up", str(path), "--fresh"], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - start
    if res.returncode != 0:
        raise RuntimeError(f"{arm}: tandem up exited {res.returncode}: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    summary = json.loads((work / "runs" / f"fsync-{arm}" / "summary.json").read_text())
    return {"launcher_wall_s": wall, "run_wall_s": float(summary["wall_s"])}


def redis_writes(arm: str, writes: int) -> float:
    """Seconds per write (XADD + SADD, one round trip each, sequential) with ``appendfsync arm``."""
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(data_dir=d, appendfsync=arm) as server:
        client = redis.Redis.from_url(server.url)
        start = time.perf_counter()
        for i in range(writes):
            client.xadd("bench:stream", {"m": b"x" * 512})
            client.sadd("bench:done", i)
        elapsed = time.perf_counter() - start
        client.close()
    return elapsed / writes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=2, help="demo runs per arm (alternated)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--writes", type=int, default=2000)
    ap.add_argument("--skip-demo", action="store_true")
    args = ap.parse_args()
    out: dict[str, dict[str, list[float]]] = {arm: {} for arm in ARMS}
    for r in range(3):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            out[arm].setdefault("redis_ms_per_write", []).append(1000 * redis_writes(arm, args.writes))
    with tempfile.TemporaryDirectory(prefix="tandem-fsync-") as tmp:
        for r in range(0 if args.skip_demo else args.rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                res = demo_run(arm, str(Path(args.model).resolve()), Path(tmp), args.steps, args.groups, args.eval)
                for k, v in res.items():
                    out[arm].setdefault(k, []).append(v)
                print(arm, res, flush=True)
    report = {arm: {k: round(statistics.median(v), 3) for k, v in m.items()} | {"n": {k: len(v) for k, v in m.items()}}
              for arm, m in out.items()}
    report["ratio_always_over_everysec"] = {k: round(report["always"][k] / report["everysec"][k], 3)
                                            for k in out["everysec"]}
    report["raw"] = out
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
