"""``python -m services.coordinator.dashboard RUN_DIR``: serve a finished run's dashboard, read-only (finished.py).

``tandem dashboard RUN`` runs this (the launcher imports no other service). It prints the URL and serves
until interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import uvicorn

from services.common.embedded_redis import free_port
from services.coordinator.dashboard import STATIC
from services.coordinator.dashboard.finished import FinishedRun, build_app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem dashboard", description="serve a finished run's dashboard, read-only")
    p.add_argument("run_dir", help="the run's directory (runs/<run>)")
    p.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    p.add_argument("--run-config", default=None, help="the run's config, for a run directory without config.json")
    args = p.parse_args(argv)
    try:
        run = FinishedRun.load(Path(args.run_dir), Path(args.run_config) if args.run_config else None)
    except (ValueError, OSError, RuntimeError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    port = args.port or free_port()
    held, archived = len(run.recent), (Path(args.run_dir) / "transcripts.jsonl.gz").is_file()
    print(f"dashboard of finished run {run.cfg.run.name} (read-only; {held} transcripts from its Redis AOF"
          f"{', and its transcript archive' if archived else ''}): http://{args.host}:{port}/", flush=True)
    uvicorn.run(build_app(run, STATIC), host=args.host, port=port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
