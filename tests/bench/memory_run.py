"""Redis memory over a long run (issue 12, docs/architecture.md §10): is the run's state bounded?

Runs the two-agent tic-tac-toe run with every service as a real process (``start_services``, as
tests/test_restart_e2e.py does) on a fresh tiny model and the smallest settings (``--group-size`` episodes a
group, one group a batch, 4 new tokens, no evaluation), against an embedded Valkey this script owns. At each
new training step (the slower agent's train-log length) it samples ``INFO memory`` ``used_memory``. After
the run: the slope of a least-squares line through (step, used_memory) past ``--warmup`` steps, in MB per
1,000 steps, and the largest key families at the end (``MEMORY USAGE``), to see what still grows.

    PYTHONPATH=$PWD python tests/bench/memory_run.py --steps 200 --out build/memory_run.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import redis
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from services.common.embedded_redis import EmbeddedRedis, free_port  # noqa: E402
from services.common.weights_auth import SECRET_ENV, run_dir_secret  # noqa: E402
from services.contracts.config import load_config  # noqa: E402
from services.launcher.processes import ProcessGroup, child_env  # noqa: E402
from services.launcher.up import start_services  # noqa: E402

RUN = "memory"


def write_config(d: Path, model: Path, args: argparse.Namespace) -> Path:
    agent = {"model_path": str(model), "groups_per_batch": 1, "max_staleness": 1, "sampling": {"max_new_tokens": 4}}
    cfg = {"run": {"name": RUN, "total_steps": args.steps, "concurrent_episodes": 8,
                   "checkpoint_root": str(d / "ckpt"), "output_dir": str(d / "runs"),
                   "trim_interval_s": args.trim_interval_s, "transcripts_kept": args.transcripts_kept},
           "api": {"port": free_port()},
           "environment": {"name": "tictactoe", "group_size": args.group_size, "roles": {"X": "A", "O": "B"},
                           "alternate_roles": True, "eval": {"episodes": 0}},
           "agents": {"A": dict(agent), "B": dict(agent)}}
    path = d / "memory.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def slope_mb_per_1000(points: list[tuple[int, int, float]]) -> float:
    """Least-squares slope of used_memory (bytes) over steps, as MB per 1,000 steps."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    return sxy / sxx * 1000 / 1e6 if sxx else float("nan")


def key_families(client: redis.Redis) -> dict[str, int]:
    """Bytes by key family (the key with its run prefix, agent and ids generalised), largest first."""
    sizes: Counter[str] = Counter()
    for key in client.scan_iter(count=1000):
        name = re.sub(rf"^tandem:{RUN}:", "", key.decode(errors="replace"))
        name = re.sub(r"[0-9a-f]{16,}", "<id>", name)
        name = re.sub(r":(A|B)(:|$)", r":<agent>\2", name)
        sizes[name] += int(client.memory_usage(key) or 0)
    return dict(sizes.most_common(15))


def trained_steps(client: redis.Redis) -> int:
    return min(int(client.llen(f"tandem:{RUN}:trainer:{a}:log")) for a in ("A", "B"))


def run(args: argparse.Namespace) -> dict:
    from services.demo.tiny_model import create_tiny_model

    d = Path(tempfile.mkdtemp(prefix="tandem-memory-"))
    model = create_tiny_model(d / "model", seed=0)
    path = write_config(d, model, args)
    cfg = load_config(path)
    server = EmbeddedRedis(data_dir=d / "redis", maxmemory_mb=cfg.run.redis_maxmemory_mb).start()
    client = redis.Redis.from_url(server.url)
    group = ProcessGroup(d / "logs", child_env({"TANDEM_REDIS_URL": server.url,
                                              SECRET_ENV: run_dir_secret(d)}), lambda name, line: None)
    points: list[tuple[int, int, float]] = []  # (step, used_memory, seconds since the start)
    started = time.time()
    try:
        start_services(cfg, str(path), group, cfg.api.port)
        coord = next(c for c in group.children if c.name == "coordinator")
        last = -1
        while coord.proc.poll() is None and time.time() - started < args.max_wall_s:
            step = trained_steps(client)
            if step > last:
                points.append((step, int(client.info("memory")["used_memory"]), round(time.time() - started, 1)))
                last = step
            time.sleep(0.25)
        families = key_families(client)
    finally:
        group.stop_all()
        client.close()
        server.stop()
    steps = points[-1][0] if points else 0
    fit = [p for p in points if p[0] >= args.warmup]
    return {"steps_requested": args.steps, "steps_done": steps, "wall_s": round(time.time() - started, 1),
            "warmup_steps": args.warmup, "points_fitted": len(fit),
            "mb_per_1000_steps": round(slope_mb_per_1000(fit), 3) if len(fit) > 2 else None,
            "used_memory_mb_first": round(points[0][1] / 1e6, 3) if points else None,
            "used_memory_mb_at_warmup": round(fit[0][1] / 1e6, 3) if fit else None,
            "used_memory_mb_last": round(points[-1][1] / 1e6, 3) if points else None,
            "settings": {"group_size": args.group_size, "groups_per_batch": 1, "transcripts_kept":
                         args.transcripts_kept, "trim_interval_s": args.trim_interval_s},
            "largest_key_families_bytes": families, "points": points, "run_dir": str(d)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=40, help="steps left out of the fit")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--transcripts-kept", type=int, default=50)
    p.add_argument("--trim-interval-s", type=float, default=5.0)
    p.add_argument("--max-wall-s", type=float, default=1800.0, help="stop sampling after this long")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in result.items() if k != "points"}, indent=2))


if __name__ == "__main__":
    main()
