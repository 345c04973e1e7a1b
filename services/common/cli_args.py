"""The arguments of ``tandem eval`` and ``tandem serve``, defined once.

Both commands parse their own command line (``eval`` in-process, ``serve`` as its own process); the
``tandem`` parser adds the same arguments to its ``eval`` and ``serve`` sub-commands so that
``tandem --help``, each sub-command's ``--help`` and the generated CLI reference show them.
"""

from __future__ import annotations

import argparse

EVAL_DESCRIPTION = (
    "Score weights on a config's held-out evaluation without starting a run: seeded episodes against the "
    "environment's scripted opponents, each agent in the roles it plays, on in-process inference engines "
    "(no Redis, engines or trainers). Prints per agent and opponent the score ± standard error, "
    "wins/draws/losses and the illegal rate, and writes them as JSON.")
SERVE_DESCRIPTION = "Serve the Tinker training API on Tandem (scripts written for the Tinker SDK run unchanged)."


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the run config (YAML) whose environment, agents and eval settings are used")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="[AGENT=]DIR",
                        help="weights to score: an HF model directory or a LoRA run's adapter directory (repeatable); "
                             "without AGENT= the directories go to the config's training agents in order; an agent "
                             "without one uses its model_path")
    parser.add_argument("--opponent", action="append", default=[],
                        help="a scripted player of the environment (repeatable); default: the config's eval opponents")
    parser.add_argument("--episodes", type=int, default=None, help="games per opponent (default: the config's "
                                                                    "environment.eval.episodes)")
    parser.add_argument("--out", default=None, help="JSON output (default runs/<run>/eval.json)")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML with a tinker_api section (optional)")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8910)")
    parser.add_argument("--data-dir", help="checkpoints, snapshots, embedded Redis (default runs/tinker)")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                        help="serve the local model DIR under the hub name NAME (repeatable)")
