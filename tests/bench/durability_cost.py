"""The cost of durability on the demo's wall time: the embedded Valkey's AOF fsync policy, ``everysec`` vs
``always`` (``run.redis_appendfsync``), as a ratio measured side by side (issue 11; docs/architecture.md §9).

The same shortened demo (``tests/bench/fsync_cost.demo_run``: ``tandem up --fresh`` of configs/demo.yaml with
``--steps`` steps, ``--groups`` groups per batch, ``--eval`` evaluation episodes) runs once per arm per round,
the order alternated round by round (everysec first, then always first, ...), so that a change in the shared
machine's load falls on both arms alike. Per round, the ratio always/everysec of the launcher's wall time and of
the run's own ``wall_s`` (``summary.json``); reported: the median of the per-round ratios, their min and max,
each arm's median, and the 1-minute load average before and after.

The run's other durable writes (the group ledger, the coordinator's record, the trainer's log) have no config
switch, so they are not an arm here: their cost is inside both arms alike.

    python tests/bench/durability_cost.py --rounds 3 [--model DIR]     (default: a tiny random model)

``run()`` is the ``durability`` entry of ``tests/bench/run_benchmarks.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.fsync_cost import ARMS, demo_run  # noqa: E402

METRICS = ("launcher_wall_s", "run_wall_s")


def measure(model: str | None, rounds: int, steps: int, groups: int, episodes: int) -> dict[str, object]:
    """Run the alternated rounds; return the figures (see the module docstring)."""
    load_before = os.getloadavg()[0]
    per_arm: dict[str, dict[str, list[float]]] = {arm: {m: [] for m in METRICS} for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="tandem-durability-") as tmp:
        if model is None:
            from services.demo.tiny_model import create_tiny_model

            model = str(create_tiny_model(Path(tmp) / "model", seed=0))
        for r in range(rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                res = demo_run(arm, str(Path(model).resolve()), Path(tmp), steps, groups, episodes)
                for m in METRICS:
                    per_arm[arm][m].append(res[m])
                print(f"round {r + 1} {arm}: {res} (load {os.getloadavg()[0]:.1f})", flush=True)
    out: dict[str, object] = {"rounds": rounds, "load_before": round(load_before, 2),
                              "load_after": round(os.getloadavg()[0], 2)}
    for m in METRICS:
        ratios = [a / e for a, e in zip(per_arm["always"][m], per_arm["everysec"][m], strict=True)]
        out[f"fsync_always_over_everysec.{m}"] = round(statistics.median(ratios), 3)
        out[f"fsync_always_over_everysec.{m}.min"] = round(min(ratios), 3)
        out[f"fsync_always_over_everysec.{m}.max"] = round(max(ratios), 3)
        for arm in ARMS:
            out[f"{arm}.{m}.median"] = round(statistics.median(per_arm[arm][m]), 2)
    out["raw"] = per_arm
    return out


def run() -> dict[str, float]:
    """The ``durability.*`` figures of ``make bench``: 2 alternated rounds of a 3-step demo on a tiny model."""
    res = measure(None, rounds=2, steps=3, groups=2, episodes=8)
    return {k: v for k, v in res.items() if isinstance(v, (int, float))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model directory (default: a tiny random model)")
    ap.add_argument("--rounds", type=int, default=2, help="demo runs per arm (alternated)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--eval", type=int, default=8)
    args = ap.parse_args()
    print(json.dumps(measure(args.model, args.rounds, args.steps, args.groups, args.eval), indent=2))


if __name__ == "__main__":
    main()
