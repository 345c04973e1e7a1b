"""What the tic-tac-toe demo model can represent: supervised learning of perfect play, not RL.

The same tiny model and warm-start loop as ``services/demo/warmstart.py`` (random-vs-random games,
each role's view rendered as the coordinator renders it), but each move's target is the uniform
distribution over minimax's best moves instead of over the legal cells. Its greedy play against
``random``, ``tactical`` and ``minimax`` (services/play's held-out evaluation) bounds what the
model's size allows; the RL demo is compared with it in the README ("Why the score against random
stops near 0.8").

    python tests/bench/ttt_capacity.py --games 3000 --epochs 12 [--hidden 64 --layers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
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
    Example,
    collate,
    eval_model,
    train_supervised,
    user_turn,
)
from services.envs.tictactoe import TicTacToe, best_moves, legal_cells  # noqa: E402


def best_move_examples(tokenizer: Any, rng: random.Random, seed: int) -> list[Example]:
    """One random-vs-random game; each role's moves targeted at minimax's best moves."""
    env = TicTacToe({}, seed)
    eos = tokenizer.eos_token_id
    digit = {c: tokenizer.encode(str(c), add_special_tokens=False)[0] for c in range(1, 10)}
    examples = {role: Example([], []) for role in env.roles}
    loop = asyncio.new_event_loop()
    try:
        while True:
            role = env.current_role()
            ex = examples[role]
            ex.tokens += user_turn(tokenizer, env.observation(role))
            ex.targets.append((len(ex.tokens), sorted({digit[c] for c in best_moves(env.board, role)})))
            cell = rng.choice(legal_cells(env.board))
            ex.tokens.append(digit[cell])
            ex.targets.append((len(ex.tokens), [eos]))
            ex.tokens.append(eos)
            if loop.run_until_complete(env.step(role, str(cell))).done:
                break
    finally:
        loop.close()
    return [ex for ex in examples.values() if ex.targets]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--games", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN)
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    ap.add_argument("--eval-games", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    out = create_tiny_model(Path(tempfile.mkdtemp(prefix="ttt_capacity_")), seed=args.seed, hidden=args.hidden,
                            layers=args.layers)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    rng = random.Random(args.seed)
    data = [ex for g in range(args.games) for ex in best_move_examples(tokenizer, rng, args.seed * 1_000_003 + g)]
    losses = train_supervised(model, data, lambda b: collate(b, tokenizer.pad_token_id, model.config.vocab_size),
                              args.epochs, DEFAULT_LR, 8, args.seed)
    model.save_pretrained(out, safe_serialization=True)
    report: dict[str, Any] = {**vars(args), "final_loss": round(losses[-1], 4), "train_seconds": 0.0}
    report["train_seconds"] = round(time.perf_counter() - start, 1)
    for opponent in ("random", "tactical", "minimax"):
        report[opponent] = eval_model(out, args.eval_games, 0.0, opponent)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
