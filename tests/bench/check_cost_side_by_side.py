"""The cost of issue 12's checks and signatures on the demo's wall time, measured side by side.

docs/architecture.md §2.3 (trust boundaries) lists the checks: the rollout's and the buffer's vocabulary and
logprob scans, the coordinator's reply check, the buffer's ledger read per sample (a group's members from the
coordinator's record), the trainer's non-finite checks and the weights' checksum, signature and verification.
``tests/bench/check_cost.py`` times them per message and scales by counts (an upper bound); this bench runs a
shortened demo (``configs/demo.yaml`` through ``tandem up``, as ``tests/bench/bench_system.py`` does: its own
embedded Redis, ports and directories, no held-out evaluation, ``--steps`` training steps) in two arms:

* ``checked``: the code as it is;
* ``unchecked``: the same run with a ``sitecustomize.py`` probe on ``PYTHONPATH`` (written by this bench into
  its temporary directory, not a production switch: nothing in ``services`` can turn the checks off). In
  every child process it replaces, right after their module is imported and before any caller imports them,
  the functions in ``PATCHED`` with no-ops that count their calls (the counts are in the report, so the
  no-ops are shown to be what ran). The strict wire types (pydantic constraints) stay: they are part of
  decoding and are not separable here (``check_cost.py`` times them: a few microseconds per message).

The arms alternate over ``--rounds`` rounds, the first arm flipping each round. Per arm and round: the run's
wall time (launch of ``tandem up`` to its exit) and seconds per training step (``bench_system``'s
``system_step_times`` / ``step_seconds`` over ``metrics.json``); the report gives the median of the per-round
ratios checked / unchecked with their min and max, and the load averages before and after each run.

    PYTHONPATH=$PWD python tests/bench/check_cost_side_by_side.py --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.common.embedded_redis import EmbeddedRedis  # noqa: E402
from tests.bench import bench_system  # noqa: E402

PROBE_ENV = "TANDEM_UNCHECKED_PROBE"

# What the probe replaces (module: attribute -> no-op); kept in step with PROBE below.
PATCHED = {
    "services.common.tokens": ["ids_problem -> None (rollout reply scan, buffer sample scan, coordinator)",
                               "logprobs_problem -> None (rollout and coordinator reply scans)"],
    "services.coordinator.replies": ["ReplyCheck.problem -> None (the coordinator's reply check)"],
    "services.buffer.store": ["SampleStore.vouch -> group_samples placeholders (no ledger HGET per sample)",
                              "vouch -> members unchecked"],
    "services.common.weights_auth": ["sign -> constant (trainer's HMAC)",
                                     "weights_checksum -> constant (trainer's SHA-256 over the version)",
                                     "refusal -> None (rollout's signature, commit and checksum check)"],
    "services.training.step": ["check_finite -> None (loss and gradient norm per minibatch)",
                               "TrainingStep.weights_finite -> True (weights after the optimizer step)"],
}

PROBE = r'''
"""Bench-only probe (tests/bench/check_cost_side_by_side.py): the §2.3 checks replaced by counting no-ops."""
import atexit
import json
import os
import sys
import time

_DIR = os.environ.get("TANDEM_UNCHECKED_PROBE")
if _DIR:
    _COUNTS = {}
    _LAST = [0.0]
    _ZERO = "0" * 64

    def _flush(force=False):
        now = time.monotonic()
        if force or now - _LAST[0] > 2.0:
            _LAST[0] = now
            with open(os.path.join(_DIR, f"{os.getpid()}.json"), "w") as f:
                json.dump(_COUNTS, f)

    def _hit(name):
        _COUNTS[name] = _COUNTS.get(name, 0) + 1
        _flush()

    def _tokens(m):
        def ids_problem(*a, **k):
            _hit("ids_problem")
        def logprobs_problem(*a, **k):
            _hit("logprobs_problem")
        m.ids_problem, m.logprobs_problem = ids_problem, logprobs_problem

    def _replies(m):
        def problem(self, reply):
            _hit("ReplyCheck.problem")
        m.ReplyCheck.problem = problem

    def _store(m):
        async def vouch_method(self, sample):
            _hit("SampleStore.vouch")
            return [sample.id] * sample.group_samples
        def vouch(sample, members, agent):
            _hit("store.vouch")
            return members
        m.SampleStore.vouch, m.vouch = vouch_method, vouch

    def _weights(m):
        def sign(*a, **k):
            _hit("sign")
            return _ZERO
        def weights_checksum(*a, **k):
            _hit("weights_checksum")
            return _ZERO
        async def refusal(*a, **k):
            _hit("refusal")
        m.sign, m.weights_checksum, m.refusal = sign, weights_checksum, refusal

    def _step(m):
        def check_finite(*a, **k):
            _hit("check_finite")
        def weights_finite(self):
            _hit("weights_finite")
            return True
        m.check_finite, m.TrainingStep.weights_finite = check_finite, weights_finite

    _PATCHES = {"services.common.tokens": _tokens, "services.coordinator.replies": _replies,
                "services.buffer.store": _store, "services.common.weights_auth": _weights,
                "services.training.step": _step}

    class _Finder:
        """Finds a patched module through the other finders and patches it right after it executes."""

        def find_spec(self, name, path, target=None):
            if name not in _PATCHES:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _PATCHES[name](module)
                _COUNTS.setdefault("patched:" + name, 0)
                _flush(force=True)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
    atexit.register(_flush, True)
'''


def write_probe(tmp: Path) -> Path:
    """The probe's directory (for ``PYTHONPATH``) with its ``sitecustomize.py``."""
    probe = tmp / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    return probe


def arm_env(arm: str, probe: Path, counts: Path) -> dict[str, str]:
    """The launcher's environment: the caller's, plus the probe on ``PYTHONPATH`` for the unchecked arm."""
    env = dict(os.environ)
    env.pop(PROBE_ENV, None)
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if arm == "unchecked":
        counts.mkdir()
        env[PROBE_ENV] = str(counts)
        paths.insert(0, str(probe))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def probe_counts(counts: Path) -> dict[str, int]:
    """The probe's call counts summed over the run's processes."""
    total: dict[str, int] = {}
    for f in sorted(counts.glob("*.json")) if counts.is_dir() else []:
        for k, v in json.loads(f.read_text() or "{}").items():
            total[k] = total.get(k, 0) + int(v)
    return total


def run_arm(tmp: Path, model: Path, probe: Path, arm: str, name: str, timeout_s: float) -> dict[str, Any]:
    """One ``tandem up`` of the shortened demo in ``arm``: wall time, seconds per step, load, probe counts."""
    work = tmp / name
    work.mkdir()
    load_before = os.getloadavg()
    with EmbeddedRedis(data_dir=work / "redis-ext") as server:
        cfg = bench_system.demo_config(work, model, name, server.url, None)
        env = arm_env(arm, probe, work / "counts")
        cmd = [sys.executable, "-m", "services.launcher.cli", "up", str(cfg)]
        with open(work / "launcher.log", "wb") as log:
            started = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(60)
            wall = time.monotonic() - started
    if proc.returncode != 0:
        tail = (work / "launcher.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"tandem up ({name}) exited {proc.returncode}:\n{tail}")
    metrics = json.loads((work / "runs" / name / "metrics.json").read_text())
    times = bench_system.system_step_times(metrics)
    return {"arm": arm, "wall_s": round(wall, 2), "step_s": round(bench_system.step_seconds(times), 3),
            "steps": len(times), "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "probe_counts": probe_counts(work / "counts") if arm == "unchecked" else None}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def summarize(rounds: list[dict[str, dict[str, Any]]], steps: int, seconds: float) -> dict[str, Any]:
    """Per-arm figures, per-round ratios checked / unchecked (median, min, max) and the loads seen."""
    arms = {a: {"wall_s": [r[a]["wall_s"] for r in rounds], "step_s": [r[a]["step_s"] for r in rounds]}
            for a in ("checked", "unchecked")}
    wall = [r["checked"]["wall_s"] / r["unchecked"]["wall_s"] for r in rounds]
    step = [r["checked"]["step_s"] / r["unchecked"]["step_s"] for r in rounds]
    loads = [x for r in rounds for a in ("checked", "unchecked")
             for x in (r[a]["load_before"][0], r[a]["load_after"][0])]
    return {
        "ratio_checked_over_unchecked": {"wall": spread(wall), "step": spread(step),
                                         "wall_per_round": [round(x, 4) for x in wall],
                                         "step_per_round": [round(x, 4) for x in step]},
        "arms": {a: {k: {"per_round": v, **spread(v)} for k, v in d.items()} for a, d in arms.items()},
        "rounds": len(rounds), "steps_per_run": steps,
        "load_average_1min": {"min": round(min(loads), 2), "max": round(max(loads), 2),
                              "median": round(statistics.median(loads), 2)},
        "patched": PATCHED, "runs": rounds, "seconds": round(seconds, 1), "cpu_count": os.cpu_count(),
    }


def check_probe(counts: dict[str, int]) -> list[str]:
    """The patched modules the unchecked run never imported or whose no-ops never ran (should be empty)."""
    missing = [m for m in PATCHED if f"patched:{m}" not in counts]
    for name in ("ids_problem", "logprobs_problem", "ReplyCheck.problem", "SampleStore.vouch", "sign",
                 "weights_checksum", "refusal", "check_finite", "weights_finite"):
        if not counts.get(name):
            missing.append(name)
    return missing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds of both arms (the first arm flips each round)")
    p.add_argument("--steps", type=int, default=8, help="training steps per run (run.total_steps)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "check_cost_side_by_side.json")
    args = p.parse_args()
    bench_system.STEPS = args.steps  # demo_config reads it
    started = time.monotonic()
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="check-cost-sbs-") as tmp_name:
        tmp = Path(tmp_name)
        model = bench_system.model_dir(tmp)
        probe = write_probe(tmp)
        for k in range(args.rounds):
            order = ("checked", "unchecked") if k % 2 == 0 else ("unchecked", "checked")
            got: dict[str, dict[str, Any]] = {}
            for arm in order:
                got[arm] = run_arm(tmp, model, probe, arm, f"ccs-{arm}-{k}", args.timeout_s)
                print(json.dumps({"round": k, **got[arm]}), flush=True)
            if missing := check_probe(got["unchecked"]["probe_counts"] or {}):
                raise RuntimeError(f"round {k}: the unchecked arm did not skip {missing}")
            rounds.append({"first": order[0], **got})
    report = summarize(rounds, args.steps, time.monotonic() - started)
    report["model"] = str(model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("ratio_checked_over_unchecked", "rounds", "load_average_1min")},
                     indent=2))


if __name__ == "__main__":
    main()
