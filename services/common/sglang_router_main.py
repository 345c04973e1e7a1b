"""``python -m services.common.sglang_router_main ARGS``: the real SGLang router (its Rust ``Router``), started as
``python -m sglang_router.launch_router ARGS`` starts it, with the same arguments, minus that launcher's
imports of its Python mini load balancer (fastapi, aiohttp, sglang: about 2 s of CPU per router, 700
modules, at the run's busiest moment; this imports 30 ms). docs/architecture.md §2.3 and §9.
"""

from __future__ import annotations

import argparse
import sys

from sglang_router.router import Router
from sglang_router.router_args import RouterArgs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.common.sglang_router_main",
                                     description="the SGLang router (sglang_router.launch_router's arguments)")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(sys.argv[1:] if argv is None else argv),
                                    use_router_prefix=False)
    if args.mini_lb:
        parser.error("--mini-lb: start sglang_router.launch_router for the Python load balancer")
    args._validate_router_args()
    Router.from_args(args).start()


if __name__ == "__main__":
    main()
