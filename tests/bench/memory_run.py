"""Redis memory over a long run (issue 12, docs/architecture.md §10): is the run's state bounded?

Runs the two-agent tic-tac-toe run with every service as a real process (``start_services``, as
tests/e2e/test_restart_e2e.py does) on a fresh tiny model and the smallest settings (``--group-size`` episodes a
group, one group a batch, 4 new tokens, no evaluation), against an embedded Valkey this script owns. At each
new training step (the slower agent's published version) it samples ``INFO memory`` ``used_memory``; every
``--family-every`` steps also the bytes of each key family (``MEMORY USAGE``). After the run: the slope of a
least-squares line through (step, used_memory) past ``--warmup`` steps, in MB per 1,000 steps, with its
standard error; the same slope per key family (what still grows, and by how much); and the slope without the
done-id sets, which are pruned by time (the stream's retention minus the producers' 600 s retry window,
services/common/retention.py) and so level off only in runs longer than that window (``--warmup-s``
fits only the points sampled after that many seconds; ``--grace-s`` sets that window, ``run.done_ids_grace_s``).
At the end it counts the done-id sets' ids and bytes and the messages handled (for the plateau formula in
docs/guides/recovery.md: grace x message rate x bytes per id).

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
    # the untrained tiny model's replies are all illegal (no learning signal): the run must not stop for that
    agent = {"model_path": str(model), "groups_per_batch": 1, "max_staleness": 1, "sampling": {"max_new_tokens": 4},
             "max_no_signal_steps": 0}
    cfg = {"run": {"name": RUN, "total_steps": args.steps, "concurrent_episodes": 8,
                   "checkpoint_root": str(d / "ckpt"), "output_dir": str(d / "runs"),
                   "trim_interval_s": args.trim_interval_s, "transcripts_kept": args.transcripts_kept},
           "api": {"port": free_port()},
           "environment": {"name": "tictactoe", "group_size": args.group_size, "roles": {"X": "A", "O": "B"},
                           "alternate_roles": True, "eval": {"episodes": 0}},
           "agents": {"A": dict(agent), "B": dict(agent)}}
    if args.grace_s:  # run.done_ids_grace_s: how long the done-id sets keep an id past its stream's retention
        cfg["run"]["done_ids_grace_s"] = args.grace_s
    if args.state_kept_steps:  # 0: leave it out (code from before the knob, for a side-by-side run)
        cfg["run"]["state_kept_steps"] = args.state_kept_steps
    path = d / "memory.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def slope_mb_per_1000(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope of bytes over steps, as MB per 1,000 steps, with its standard error."""
    n = len(points)
    if n < 3:
        return float("nan"), float("nan")
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if not sxx:
        return float("nan"), float("nan")
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    resid = sum((p[1] - my - b * (p[0] - mx)) ** 2 for p in points)
    se = (resid / (n - 2) / sxx) ** 0.5
    return b * 1000 / 1e6, se * 1000 / 1e6


def key_families(client: redis.Redis) -> dict[str, int]:
    """Bytes by key family (the key with its run prefix, agent and ids generalised), largest first."""
    sizes: Counter[str] = Counter()
    for key in client.scan_iter(count=1000):
        name = re.sub(rf"^tandem:{RUN}:", "", key.decode(errors="replace"))
        name = re.sub(r"[0-9a-f]{16,}", "<id>", name)
        name = re.sub(r":(A|B)(:|$)", r":<agent>\2", name)
        sizes[name] += int(client.memory_usage(key) or 0)
    return dict(sizes.most_common())


def trained_steps(client: redis.Redis, run: str = RUN) -> int:
    """The slower agent's published version (the train log itself is bounded: it no longer counts steps)."""
    return min(int(client.get(f"tandem:{run}:state:{a}:published_version") or 0) for a in ("A", "B"))


def family_slopes(samples: list[tuple[int, dict[str, int]]], warmup: int) -> dict[str, float]:
    """MB per 1,000 steps of each key family past ``warmup`` (the largest growth first)."""
    fit = [(step, fam) for step, fam in samples if step >= warmup]
    names = {n for _, fam in fit for n in fam}
    out = {n: slope_mb_per_1000([(step, fam.get(n, 0)) for step, fam in fit])[0] for n in names}
    return {n: round(v, 3) for n, v in sorted(out.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= 0.005}


def is_done_set(family: str) -> bool:
    return ":done:" in family


def done_ids(client: redis.Redis, run: str = RUN) -> dict[str, float]:
    """The ids in every done-id set, their bytes, and the messages handled so far: each stream's entries ever
    added (``XINFO STREAM`` entries-added) once per consumer group reading it (the plateau formula's rate)."""
    ids = size = handled = 0
    for key in client.scan_iter(match=f"tandem:{run}:*", count=1000):
        kind = client.type(key)
        if kind == b"zset" and b":done:" in key:
            ids += int(client.zcard(key))
            size += int(client.memory_usage(key) or 0)
        elif kind == b"stream":
            added = int(client.xinfo_stream(key).get("entries-added") or 0)
            handled += added * len(client.xinfo_groups(key))
    return {"ids": ids, "bytes": size, "handled": handled}


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
    families: list[tuple[int, dict[str, int]]] = []  # (step, bytes by key family), every --family-every steps
    started = time.time()
    try:
        start_services(cfg, str(path), group, cfg.api.port)
        coord = next(c for c in group.children if c.name == "coordinator")
        last = -1
        while coord.proc.poll() is None and time.time() - started < args.max_wall_s:
            step = trained_steps(client)
            if step > last:
                points.append((step, int(client.info("memory")["used_memory"]), round(time.time() - started, 1)))
                if step % args.family_every == 0 or not families:
                    families.append((step, key_families(client)))
                last = step
            time.sleep(0.25)
        families.append((trained_steps(client), key_families(client)))
        ids = {**done_ids(client), "wall_s": round(time.time() - started, 1)}
    finally:
        group.stop_all()
        client.close()
        server.stop()
    return {**summarise(args, points, families, d), "done_ids_at_end": ids}


def summarise(args: argparse.Namespace, points: list[tuple[int, int, float]],
              families: list[tuple[int, dict[str, int]]], d: Path) -> dict:
    steps = points[-1][0] if points else 0
    fit = [p for p in points if p[0] >= args.warmup and p[2] >= args.warmup_s]
    warm = fit[0][0] if fit else steps + 1
    slope, se = slope_mb_per_1000([(p[0], p[1]) for p in fit])
    fam_fit = [(step, fam) for step, fam in families if step >= warm]
    no_done, no_done_se = slope_mb_per_1000([(step, sum(v for n, v in fam.items() if not is_done_set(n)))
                                             for step, fam in fam_fit])
    done, _ = slope_mb_per_1000([(step, sum(v for n, v in fam.items() if is_done_set(n))) for step, fam in fam_fit])
    last = families[-1][1] if families else {}
    return {"steps_requested": args.steps, "steps_done": steps, "wall_s": points[-1][2] if points else None,
            "warmup_steps": args.warmup, "warmup_s": args.warmup_s, "first_fitted_step": warm,
            "points_fitted": len(fit),
            "mb_per_1000_steps": round(slope, 3), "mb_per_1000_steps_se": round(se, 3),
            "keys_mb_per_1000_steps": {"all_but_done_sets": round(no_done, 3), "all_but_done_sets_se":
                                       round(no_done_se, 3), "done_sets": round(done, 3)},
            "family_mb_per_1000_steps": family_slopes(fam_fit, warm),
            "used_memory_mb_first": round(points[0][1] / 1e6, 3) if points else None,
            "used_memory_mb_at_warmup": round(fit[0][1] / 1e6, 3) if fit else None,
            "used_memory_mb_last": round(points[-1][1] / 1e6, 3) if points else None,
            "settings": {"group_size": args.group_size, "groups_per_batch": 1, "transcripts_kept":
                         args.transcripts_kept, "trim_interval_s": args.trim_interval_s,
                         "state_kept_steps": args.state_kept_steps},
            "largest_key_families_bytes": dict(list(last.items())[:15]),
            "points": points, "families": families, "run_dir": str(d)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=80, help="steps left out of the fit (the kept window fills)")
    p.add_argument("--warmup-s", type=float, default=0.0, help="seconds left out of the fit (700: past the "
                   "done-sets' 600 s retry grace)")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--transcripts-kept", type=int, default=50)
    p.add_argument("--state-kept-steps", type=int, default=50, help="run.state_kept_steps (the default); "
                   "0 leaves it out of the config (older code)")
    p.add_argument("--trim-interval-s", type=float, default=5.0)
    p.add_argument("--family-every", type=int, default=10, help="sample key families every N steps")
    p.add_argument("--max-wall-s", type=float, default=1800.0, help="stop sampling after this long")
    p.add_argument("--grace-s", type=float, default=0.0, help="run.done_ids_grace_s (0: the default, 600 s)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in result.items() if k not in ("points", "families")}, indent=2))


if __name__ == "__main__":
    main()
