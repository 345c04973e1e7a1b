"""CLI: ``python -m services.engine --model-path DIR --port P [--host H] [--weight-version N]
[--max-batch B] [--engine-id ID]`` serves the embedded engine with uvicorn."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from services.engine.server import create_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.engine", description=__doc__)
    parser.add_argument("--model-path", required=True, help="local HF model directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--engine-id", default=None,
                        help="reported as meta_info.engine in /generate replies (SGLang has no such field)")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(args.model_path, weight_version=args.weight_version, max_batch=args.max_batch,
                     engine_id=args.engine_id)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
