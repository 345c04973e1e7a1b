"""``python -m services.tinker_api [CONFIG] [--host H] [--port N]``: serve the Tinker API until stopped."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from services.common.cli_args import SERVE_DESCRIPTION, add_serve_arguments
from services.common.embedded_redis import EmbeddedRedis
from services.tinker_api.app import create_app
from services.tinker_api.config import ConfigFileError, load_serve_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve", description=SERVE_DESCRIPTION)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = load_serve_config(args.config)
    except ConfigFileError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    cfg.host = args.host or cfg.host
    cfg.port = cfg.port if args.port is None else args.port
    if args.data_dir:
        cfg.data_dir = type(cfg.data_dir)(args.data_dir)
    cfg.data_dir = cfg.data_dir.resolve()  # engines and snapshots are keyed by absolute paths
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    redis = None
    if cfg.redis_url is None:
        redis = EmbeddedRedis(data_dir=cfg.data_dir / "redis").start()
    try:
        app = create_app(cfg, cfg.redis_url or redis.url)  # type: ignore[union-attr]
        logging.getLogger("tandem.tinker_api").info("Tinker API on http://%s:%d (data in %s)",
                                                    cfg.host, cfg.port, cfg.data_dir)
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    finally:
        if redis is not None:
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
