"""The real-model demo through every service against the same loop in one process (goal <= 1.5).

``system.llm_step_time_ratio_vs_in_process``: seconds per training step of ``configs/llm_answer.yaml``
(two SmolLM2-135M-Instruct agents, LoRA r 8, GRPO, answer_then_answer) under ``tandem up`` over seconds
per step of the same config's work in one process (``tests/bench/inprocess_loop.py``: the agents'
own ``TorchPolicy`` and in-process engines, the coordinator's groups and seeds, services/play's
episodes, train, save, load the adapter). The system run is bench_system's ``run_up`` (its own
Redis, ports and directories; ``total_steps`` = ``BENCH_LLM_SYSTEM_STEPS``, default 4; no held-out
evaluation); its figure is the mean interval between steps from the first ``TrainStep`` on, the
in-process one the median of its steps after the first. ``system.llm`` also splits a system step
into its play phase (from the previous version to the step's last group played: adapter sync and
episodes) and its train phase (to the step's ``TrainStep``: batch hand-off, training, save), with
the trainers' own ``train_seconds``, beside the in-process arm's play / train / sync seconds.

The model: ``BENCH_LLM_DIR``, else ``models/smollm2-135m-instruct``, else
``/work/models/smollm2-135m-instruct``; absent, the section says it was skipped and why.
Arms run one after another on a shared 2-core box: the load before and after is part of the result.

    PYTHONPATH=. python tests/bench/bench_llm_system.py
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.bench_system import run_up, system_step_times  # noqa: E402

CONFIG = ROOT / "configs" / "llm_answer.yaml"
STEPS = int(os.environ.get("BENCH_LLM_SYSTEM_STEPS", "4"))
TIMEOUT_S = float(os.environ.get("BENCH_LLM_SYSTEM_TIMEOUT_S", "3600"))  # a step is minutes on a busy 2-core box
CANDIDATES = [ROOT / "models" / "smollm2-135m-instruct", Path("/work/models/smollm2-135m-instruct")]


def model_dir() -> Path | None:
    """The SmolLM2 directory to run on, or None when there is none."""
    named = os.environ.get("BENCH_LLM_DIR")
    for path in [Path(named)] if named else CANDIDATES:
        if (path / "config.json").is_file():
            return path.resolve()
    return None


def phases(metrics: dict[str, Any], groups_per_batch: int) -> list[dict[str, float]]:
    """Per system step k >= 2: ``play_s`` from version k-1 (both agents') to the last group of step k played,
    ``train_s`` from there to version k (both agents'), ``trainer_s`` the slower trainer's ``train_seconds``."""
    done = system_step_times(metrics)
    played = [max(ts) for ts in zip(*[batch_ends(a["group_rewards"], groups_per_batch) for a in metrics.values()],
                                    strict=False)]
    trainer = [max(ts) for ts in zip(*[[float(s.get("train_seconds") or 0.0) for s in
                                        sorted(a["train_steps"], key=lambda s: s["weight_version"])]
                                       for a in metrics.values()], strict=False)]
    return [{"play_s": played[k] - done[k - 1], "train_s": done[k] - played[k], "trainer_s": trainer[k]}
            for k in range(1, min(len(done), len(played), len(trainer)))]


def batch_ends(group_rewards: list[list[float]], groups_per_batch: int) -> list[float]:
    """When each batch's last group was played: every ``groups_per_batch``-th group's emit time."""
    times = sorted(t for t, _ in group_rewards)
    return times[groups_per_batch - 1::groups_per_batch]


def mean_of(rows: list[dict[str, float]], key: str) -> float | None:
    return round(statistics.mean(r[key] for r in rows), 2) if rows else None


def system_arm(tmp: Path, model: Path) -> dict[str, Any]:
    """``tandem up`` of the shortened config: seconds per step and its phases."""
    import yaml

    name = "bench-llm"
    result = run_up(tmp, model, name, None, source=CONFIG, steps=STEPS, timeout_s=TIMEOUT_S)
    metrics = json.loads((tmp / name / "runs" / name / "metrics.json").read_text())
    gpb = yaml.safe_load(CONFIG.read_text())["agents"]["A"]["groups_per_batch"]
    rows = phases(metrics, gpb)
    return {**result, "play_s": mean_of(rows, "play_s"), "train_s": mean_of(rows, "train_s"),
            "trainer_train_seconds": mean_of(rows, "trainer_s")}


def in_process_arm(model: Path) -> dict[str, Any]:
    """The same config in one process (inprocess_loop): the median step after the first, and its phases."""
    from services.contracts.config import load_config
    from tests.bench import inprocess_loop

    cfg = load_config(CONFIG)
    for acfg in cfg.agents.values():
        acfg.model_path = str(model)
    rows = asyncio.run(inprocess_loop.run(cfg, STEPS))
    later = rows[1:] or rows
    return {"step_s": round(statistics.median(r["seconds"] for r in later), 3),
            **{k: mean_of(later, k) for k in ("play_s", "train_s", "sync_s")},
            "threads": rows[0]["threads"], "per_step_s": [r["seconds"] for r in rows]}


def run() -> dict[str, Any]:
    """``make bench``'s entry: the ``system`` section's ``llm_step_time_ratio_vs_in_process`` and ``llm``."""
    model = model_dir()
    if model is None:
        where = os.environ.get("BENCH_LLM_DIR") or " or ".join(map(str, CANDIDATES))
        why = f"no SmolLM2 model at {where} (BENCH_LLM_DIR names one): `tandem init-model smollm2`"
        return {"system": {"llm": {"skipped": why}}}
    load_before, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-llm-system-") as tmp_name:
        system = system_arm(Path(tmp_name), model)
    load_between = os.getloadavg()
    in_proc = in_process_arm(model)
    return {"system": {
        "llm_step_time_ratio_vs_in_process": round(system["step_s"] / in_proc["step_s"], 2),
        "llm": {"config": str(CONFIG.relative_to(ROOT)), "model": str(model), "steps": STEPS,
                "system": system, "in_process": in_proc,
                "load_average": [round(x[0], 2) for x in (load_before, load_between, os.getloadavg())],
                "seconds": round(time.perf_counter() - started, 1)}}}


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
