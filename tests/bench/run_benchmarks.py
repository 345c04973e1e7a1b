"""``make bench``: run every benchmark and write ``build/bench.json``.

Each benchmark module exposes ``run() -> dict[str, float]``; its figures are
stored under the module's short name (``codec.*``, ``engine.*``, ...).
Figures are ratios measured side by side in one run where it matters; ``machine.load_average`` (the
1-minute load when the run started) says how busy the shared box was. The engine's headline is
``engine.ratio_vs_batched_generate`` (per concurrency; see ``bench_engine``). ``bench_system`` returns
whole sections (``system.step_time_ratio_vs_in_process``, ``startup.first_turn_s``,
``async.step_rate_ratio``), merged at the top level, and ``bench_llm_system`` adds the real-model demo's
``system.llm_step_time_ratio_vs_in_process`` and ``system.llm``; ``bench_engine_llm`` and ``bench_trainer_llm`` add the
real-model figures to ``engine.*`` and ``trainer.*``, and ``bench_adapter_sync`` the ``weights`` and ``memory``
sections (``weights.adapter_sync_bytes_ratio``, ``memory.shared_base_rss_ratio``, ...); each runs alone
(``python tests/bench/bench_engine_llm.py``). ``seconds`` gives each benchmark's wall time and the
total (docs/architecture.md §9). ``BENCH_SKIP`` (comma-separated short names, e.g. ``system_llm``) leaves
benchmarks out.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BENCHMARKS = {"codec": "tests.bench.bench_codec", "engine": "tests.bench.bench_engine",
              "engine_llm": "tests.bench.bench_engine_llm",
              "trainer": "tests.bench.bench_trainer", "trainer_llm": "tests.bench.bench_trainer_llm",
              "bus": "tests.bench.bench_bus", "tinker_api": "tests.bench.bench_tinker",
              "durability": "tests.bench.durability_cost", "system": "tests.bench.bench_system",
              "system_llm": "tests.bench.bench_llm_system", "adapter_sync": "tests.bench.bench_adapter_sync"}
# these return top-level sections, not figures under their own name (merged into a section already there)
SECTIONS = {"system", "system_llm", "engine_llm", "trainer_llm", "adapter_sync"}
# BENCH_SKIP=system_llm,tinker_api: benchmarks left out of this run (named in the output's ``skipped``)
SKIP = {name for name in os.environ.get("BENCH_SKIP", "").split(",") if name}


def main() -> None:
    results: dict[str, object] = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                                              "processor": platform.processor() or platform.machine(),
                                              "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}}
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    for name, module in BENCHMARKS.items():
        if name in SKIP:
            continue
        print(f"running {name} ...", flush=True)
        t0 = time.perf_counter()
        figures = importlib.import_module(module).run()
        seconds[name] = round(time.perf_counter() - t0, 1)
        if name in SECTIONS:
            for key, value in figures.items():
                section = results.get(key)
                results[key] = {**section, **value} if isinstance(section, dict) and isinstance(value, dict) else value
        else:
            results[name] = figures
    results["skipped"] = sorted(SKIP & BENCHMARKS.keys())
    results["seconds"] = {**seconds, "total": round(time.perf_counter() - started, 1)}
    out = ROOT / "build" / "bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
