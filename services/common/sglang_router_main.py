"""``python -m services.common.sglang_router_main ARGS``: the real SGLang router (its Rust ``Router``), started as
``python -m sglang_router.launch_router ARGS`` starts it, with the same arguments, minus that launcher's
imports of its Python mini load balancer (fastapi, aiohttp, sglang: about 2 s of CPU per router, 700
modules, at the run's busiest moment; this imports 30 ms). docs/architecture.md §2.3 and §9.

``--admin-token-from-env`` (this wrapper's one flag of its own) sets the router's ``--api-key`` and its
``--control-plane-api-keys`` (one admin key) to ``$TANDEM_ADMIN_TOKEN``, handed to the Rust router in process:
the token never appears on a command line.
"""

from __future__ import annotations

import argparse
import sys

from sglang_router.router import Router
from sglang_router.router_args import RouterArgs

from services.common.admin_token import ADMIN_TOKEN_ENV, token_from_env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.common.sglang_router_main",
                                     description="the SGLang router (sglang_router.launch_router's arguments)")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    parser.add_argument("--admin-token-from-env", action="store_true",
                        help=f"the API key and the admin control-plane key from ${ADMIN_TOKEN_ENV}")
    parsed = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args = RouterArgs.from_cli_args(parsed, use_router_prefix=False)
    if parsed.admin_token_from_env:
        if (token := token_from_env()) is None:
            parser.error(f"--admin-token-from-env: ${ADMIN_TOKEN_ENV} is not set")
        args.api_key = token
        args.control_plane_api_keys = [("tandem", "rollout", token, "admin")]  # (id, name, key, role) as parsed
    if args.mini_lb:
        parser.error("--mini-lb: start sglang_router.launch_router for the Python load balancer")
    args._validate_router_args()
    Router.from_args(args).start()


if __name__ == "__main__":
    main()
