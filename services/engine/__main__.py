"""CLI: ``python -m services.engine --model-path DIR --port P [--host H] [--weight-version N] [--agent A]
[--max-batch B] [--engine-id ID] [--admit-quiet-ms Q] [--admit-window-ms W] [--device D] [--dtype T]
[--prefix-cache-mb M] [--step-delay-ms S] [--http H] [--loop L] [--shared-with B ...]`` serves the
embedded engine with uvicorn (``auto``: httptools and uvloop where installed, else h11 and asyncio). Its
admin routes need the token in ``$TANDEM_ADMIN_TOKEN``; with ``--agent A`` it loads only versions A's
trainer signed with the run's secret (``$TANDEM_WEIGHTS_SECRET``; the rollout's engines always get both:
services/engine/server.py), and with ``--shared-with B`` also the adapters B's trainer signed (B's
rollout shares the engine)."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from services.common.admin_token import token_from_env
from services.common.startup import startup
from services.common.weights_auth import run_secret, secret_problem

# Idle keep-alive connections are kept longer than HTTP clients keep theirs (httpx and aiohttp: 5 s
# and 15 s), so a client never reuses a connection that the engine is closing at that moment.
KEEP_ALIVE_S = 65


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.engine", description=__doc__)
    parser.add_argument("--model-path", required=True, help="local HF model directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--engine-id", default=None,
                        help="reported as meta_info.engine in /generate replies (SGLang has no such field)")
    parser.add_argument("--admit-quiet-ms", type=float, default=2.0,
                        help="admit queued requests once none has arrived for this long")
    parser.add_argument("--admit-window-ms", type=float, default=20.0,
                        help="... or once the oldest queued request has waited this long")
    parser.add_argument("--switch-interval-ms", type=float, default=5.0,
                        help="the interpreter's thread switch interval (Python's default: 5 ms): how long the "
                             "event loop and the model thread may wait for each other's GIL")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"],
                        help="where the model runs (the agent's embedded.device); cuda needs a GPU")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    parser.add_argument("--prefix-cache-mb", type=float, default=256.0,
                        help="KV cache kept for prompts that extend finished sequences (0: none)")
    parser.add_argument("--step-delay-ms", type=float, default=0.0,
                        help="pause before every decode step (a deliberately slow engine: drills, tests)")
    parser.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                        help="uvicorn's HTTP parser")
    parser.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"], help="uvicorn's event loop")
    parser.add_argument("--agent", default=None,
                        help="the agent whose trainer's signed versions alone this engine loads (with the run's "
                             "secret in $TANDEM_WEIGHTS_SECRET or $TANDEM_WEIGHTS_SECRET_FILE)")
    parser.add_argument("--shared-with", action="append", default=[],
                        help="an agent sharing this engine (repeatable): its signed adapters load too")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.admit_quiet_ms < 0 or args.admit_window_ms < 0:
        parser.error("--admit-quiet-ms and --admit-window-ms must be >= 0")
    if args.prefix_cache_mb < 0 or args.step_delay_ms < 0:
        parser.error("--prefix-cache-mb and --step-delay-ms must be >= 0")
    if args.switch_interval_ms <= 0:
        parser.error("--switch-interval-ms must be > 0")
    sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.agent is not None and (no_secret := secret_problem()) is not None:
        parser.error(f"--agent {args.agent}: {no_secret}")
    secret = run_secret() if args.agent is not None else None
    if secret is None:
        logging.getLogger("tandem.engine").warning("no --agent: weight loads are guarded by the admin token alone")
    with startup():  # torch, transformers and the model: no collector passes over their objects
        from services.engine.server import create_app

        app = create_app(args.model_path, weight_version=args.weight_version, max_batch=args.max_batch,
                         engine_id=args.engine_id, admit_quiet_s=args.admit_quiet_ms / 1000,
                         admit_window_s=args.admit_window_ms / 1000, admin_token=token_from_env(),
                         device=args.device, dtype=args.dtype, weights_secret=secret, agent=args.agent,
                         shared_with=tuple(args.shared_with),
                         engine_options={"prefix_cache_mb": args.prefix_cache_mb,
                                         "step_delay_s": args.step_delay_ms / 1000})
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_keep_alive=KEEP_ALIVE_S, http=args.http, loop=args.loop)


if __name__ == "__main__":
    main()
