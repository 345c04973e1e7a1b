"""``python -m services.tinker_api [CONFIG] [--host H] [--port N]``: serve the Tinker API until stopped.

``python -m services.tinker_api export TINKER_PATH DIR [CONFIG] [--data-dir D]`` (``tandem serve export``)
copies a checkpoint out of the data directory for an operator, without a running server.
Arguments and the config are checked before the server's modules (torch, transformers, peft: seconds of
imports) load, so a bad one is refused at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from services.common.cli_args import SERVE_DESCRIPTION, add_serve_arguments
from services.common.embedded_redis import EmbeddedRedis
from services.common.startup import startup
from services.tinker_api.config import ConfigFileError, ensure_auth, load_serve_config


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve export", description="Copy a checkpoint out of the "
                                     "server's data directory (a training state becomes a PEFT adapter).")
    parser.add_argument("tinker_path", help="tinker://MODEL_ID/{weights|sampler_weights|external_weights}/NAME")
    parser.add_argument("out_dir", help="where to write it (must be empty or absent)")
    parser.add_argument("config", nargs="?", help="the server's YAML (for its data_dir)")
    parser.add_argument("--data-dir", help="the server's data directory (default: the config's, or runs/tinker)")
    args = parser.parse_args(argv)
    from services.tinker_api.checkpoints import export
    from services.tinker_api.losses import UserError

    try:
        cfg = load_serve_config(args.config)
        out = export(Path(args.data_dir or cfg.data_dir), args.tinker_path, Path(args.out_dir))
    except (ConfigFileError, UserError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tandem serve", description=SERVE_DESCRIPTION)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    for item in args.model:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            print(f"--model: {item!r} is not NAME=DIR", file=sys.stderr)
            return 2
        if not (Path(path) / "config.json").is_file():
            print(f"--model {name}: {path} is not a local model directory (no config.json)", file=sys.stderr)
            return 2
    try:
        cfg = load_serve_config(args.config)
    except ConfigFileError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    cfg.host = args.host or cfg.host
    cfg.port = cfg.port if args.port is None else args.port
    if args.data_dir:
        cfg.data_dir = type(cfg.data_dir)(args.data_dir)
    cfg.models.update({n: Path(p).resolve() for n, p in (m.split("=", 1) for m in args.model)})
    cfg.data_dir = cfg.data_dir.resolve()  # engines and snapshots are keyed by absolute paths
    key_file = ensure_auth(cfg)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    with startup():  # torch, transformers and peft: no collector passes over their objects
        from services.tinker_api.app import create_app

    redis = None
    if cfg.redis_url is None:
        redis = EmbeddedRedis(data_dir=cfg.data_dir / "redis").start()
    try:
        app = create_app(cfg, cfg.redis_url or redis.url)  # type: ignore[union-attr]
        log = logging.getLogger("tandem.tinker_api")
        log.info("Tinker API on http://%s:%d (data in %s)", cfg.host, cfg.port, cfg.data_dir)
        if key_file is not None:
            log.info("%s is beyond loopback and no api_keys are set: clients need TINKER_API_KEY from %s "
                     "(open_beyond_loopback: true serves it open)", cfg.host, key_file)
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    finally:
        if redis is not None:
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
