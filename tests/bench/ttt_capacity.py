"""What the tic-tac-toe demo model can represent: supervised learning of perfect play, not RL.

The same tiny model and warm-start loop as ``services/demo/warmstart.py`` (random-vs-random games,
each role's view rendered as the coordinator renders it), but each move's target is the uniform
distribution over minimax's best moves instead of over the legal cells. Its greedy play against
``random``, ``tactical`` and ``minimax`` (services/play's held-out evaluation) bounds what the
model's size allows; the RL demo is compared with it in the README ("What moved the long demo
toward 0.85"). It also prints the ceiling against ``random`` (``ceiling``: the expected score, win 1 draw 1/2, of
the best reply to a uniformly random player, by expectimax, and of ``minimax`` with random tie-breaks),
per side: where an agent's points against ``random`` are lost.

    python tests/bench/ttt_capacity.py --games 3000 --epochs 12 [--hidden 64 --layers 2]
    python tests/bench/ttt_capacity.py --ceiling-only
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from services.demo.tiny_model import create_tiny_model  # noqa: E402
from services.demo.warmstart import (  # noqa: E402
    DEFAULT_HIDDEN,
    DEFAULT_LAYERS,
    DEFAULT_LR,
    collate,
    eval_model,
    random_game_examples,
    train_supervised,
)
from services.envs.tictactoe import MARKS, best_moves, legal_cells, winner_of  # noqa: E402


@cache
def expected_vs_random(board: str, to_move: str, me: str, policy: str) -> float:
    """``me``'s expected score from ``board`` against a uniformly random other side, ``me`` playing ``best``
    (the move of highest expectation) or ``minimax`` (one of its best moves, uniformly)."""
    won = winner_of(board)
    if won is not None or "." not in board:
        return 0.5 if won is None else float(won == me)
    nxt = "O" if to_move == "X" else "X"
    cells = best_moves(board, me) if to_move == me and policy == "minimax" else legal_cells(board)
    values = [expected_vs_random(board[:c - 1] + MARKS[to_move] + board[c:], nxt, me, policy) for c in cells]
    return max(values) if to_move == me and policy == "best" else sum(values) / len(values)


def ceiling() -> dict[str, dict[str, float]]:
    """Per policy, the expected score against ``random`` as X, as O and over both sides."""
    out = {}
    for policy in ("best", "minimax"):
        x, o = (round(expected_vs_random("." * 9, "X", me, policy), 3) for me in ("X", "O"))
        out[policy] = {"X": x, "O": o, "both": round((x + o) / 2, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--games", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN)
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    ap.add_argument("--eval-games", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ceiling-only", action="store_true", help="print the ceiling against random; train nothing")
    args = ap.parse_args()
    if args.ceiling_only:
        print(json.dumps({"ceiling_vs_random": ceiling()}, indent=1))
        return
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    out = create_tiny_model(Path(tempfile.mkdtemp(prefix="ttt_capacity_")), seed=args.seed, hidden=args.hidden,
                            layers=args.layers)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    rng = random.Random(args.seed)
    data = [ex for g in range(args.games)
            for ex in random_game_examples(tokenizer, rng, args.seed * 1_000_003 + g, best_moves)]
    losses = train_supervised(model, data, lambda b: collate(b, tokenizer.pad_token_id, model.config.vocab_size),
                              args.epochs, DEFAULT_LR, 8, args.seed)
    model.save_pretrained(out, safe_serialization=True)
    report: dict[str, Any] = {**vars(args), "final_loss": round(losses[-1], 4), "train_seconds": 0.0,
                              "ceiling_vs_random": ceiling()}
    report["train_seconds"] = round(time.perf_counter() - start, 1)
    for opponent in ("random", "tactical", "minimax"):
        report[opponent] = eval_model(out, args.eval_games, 0.0, opponent)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
