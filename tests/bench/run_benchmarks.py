"""``make bench``: run every benchmark and write ``build/bench.json``.

Each benchmark module exposes ``run() -> dict[str, float]``; its figures are
stored under the module's short name (``codec.*``, ``engine.*``, ...).
Figures are ratios measured side by side in one run where it matters; ``machine.load_average`` (the
1-minute load when the run started) says how busy the shared box was. The engine's headline is
``engine.ratio_vs_batched_generate`` (per concurrency; see ``bench_engine``).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BENCHMARKS = {"codec": "tests.bench.bench_codec", "engine": "tests.bench.bench_engine",
              "trainer": "tests.bench.bench_trainer",
              "bus": "tests.bench.bench_bus", "tinker_api": "tests.bench.bench_tinker",
              "durability": "tests.bench.durability_cost"}


def main() -> None:
    results: dict[str, object] = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                                              "processor": platform.processor() or platform.machine(),
                                              "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}}
    for name, module in BENCHMARKS.items():
        print(f"running {name} ...", flush=True)
        results[name] = importlib.import_module(module).run()
    out = ROOT / "build" / "bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
