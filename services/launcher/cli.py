"""``tandem`` command line: ``up``, ``validate``, ``init-demo``, ``envs``, ``eval``, ``serve``, ``runs``,
``compare``, ``sweep``."""

from __future__ import annotations

import argparse
import os
import sys

from services.contracts.config import ConfigError, load_config
from services.launcher import run_lock
from services.launcher.preflight import preflight
from services.launcher.runs import add_run_commands, run_command
from services.launcher.sweep import add_sweep_command, sweep_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Co-train LLM agents over Redis Streams.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start Redis and every service locally and run the experiment")
    p_up.add_argument("config")
    state = p_up.add_mutually_exclusive_group()
    state.add_argument("--resume", action="store_true",
                       help="continue a stopped, crashed or interrupted run from its Redis data and checkpoints")
    state.add_argument("--fresh", action="store_true",
                       help="delete the run's directory, checkpoints and Redis keys first, then start over")
    p_val = sub.add_parser("validate", help="check a config and exit")
    p_val.add_argument("config")
    p_demo = sub.add_parser("init-demo", help="create and warm-start the demo model (skipped if present)")
    p_demo.add_argument("out_dir", nargs="?", default=None, help="default models/demo-ttt (--task guess: "
                        "models/demo-guess)")
    p_demo.add_argument("--task", choices=["tictactoe", "guess"], default="tictactoe",
                        help="tictactoe: the two-agent demo's model; guess: the guess-the-number language demo's")
    p_demo.add_argument("--force", action="store_true")
    sub.add_parser("envs", help="list the registered environments with their roles")
    sub.add_parser("eval", help="score weights on a config's environment (tandem eval CONFIG --help)",
                   add_help=False)
    sub.add_parser("serve", help="serve the Tinker training API (tandem serve [CONFIG] [--port N])", add_help=False)
    add_run_commands(sub)
    add_sweep_command(sub)
    return parser


def pass_through(argv: list[str]) -> None:
    """``serve`` and ``eval`` parse their own options."""
    if argv[:1] == ["serve"]:  # becomes the service's own process (services do not import each other)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.execv(sys.executable, [sys.executable, "-m", "services.tinker_api", *argv[1:]])
    if argv[:1] == ["eval"]:  # services/play/offline_eval.py, run in-process
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        from services.play.offline_eval import main as eval_main

        raise SystemExit(eval_main(argv[1:]))


def init_demo(out_dir: str | None, force: bool, task: str = "tictactoe") -> None:
    """Create and warm-start the demo model. The models are tiny: torch runs one thread unless
    ``OMP_NUM_THREADS`` says otherwise (more only spin: ~15x slower on a loaded 2-core machine)."""
    from pathlib import Path

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch is first imported, just below

    out_dir = out_dir or ("models/demo-guess" if task == "guess" else "models/demo-ttt")
    if (Path(out_dir) / "model.safetensors").exists() and not force:
        print(f"demo model already at {out_dir}")
        return
    if task == "guess":
        from services.demo.language import warmstart_guess

        warmstart_guess(out_dir)
        return
    from services.demo.warmstart import warmstart

    warmstart(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    pass_through(argv)
    args = parser.parse_args(argv)
    if args.command == "envs":
        from services.envs.registry import describe_environments

        print(describe_environments())
        return
    if args.command in ("runs", "compare"):
        raise SystemExit(run_command(args))
    if args.command == "sweep":
        raise SystemExit(sweep_command(args))
    if args.command == "init-demo":
        return init_demo(args.out_dir, args.force, args.task)
    mode = "validate" if args.command == "validate" else (
        "resume" if args.resume else "fresh" if args.fresh else "new")
    try:
        cfg = load_config(args.config)
        if mode != "validate":  # before preflight: a live run is refused as live, not as "exists"
            run_lock.check_live(cfg)
        preflight(cfg, args.config, mode)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None
    except run_lock.RunIsLive as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(run_lock.RUN_IS_LIVE) from None
    if args.command == "validate":
        print(f"{args.config}: ok ({len(cfg.agents)} agents, environment {cfg.environment.name})")
        return
    from services.launcher.up import up

    try:
        code = up(cfg, args.config, resume=args.resume, fresh=args.fresh)
    except run_lock.RunIsLive as exc:  # another launcher took the run since the check
        print(str(exc), file=sys.stderr)
        code = run_lock.RUN_IS_LIVE
    raise SystemExit(code)


if __name__ == "__main__":
    main()
