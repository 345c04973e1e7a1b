"""What the tic-tac-toe demo model can represent: supervised learning of perfect play, not RL.

The same tiny model and warm-start loop as ``services/demo/warmstart.py`` (random-vs-random games,
each role's view rendered as the coordinator renders it), but each move's target is the uniform
distribution over minimax's best moves instead of over the legal cells. Its greedy play against
``random``, ``tactical`` and ``minimax`` (services/play's held-out evaluation) bounds what the
model's size allows; the RL demo is compared with it in the README ("What got the long demo past
0.85").

    python tests/bench/ttt_capacity.py --games 3000 --epochs 12 [--hidden 64 --layers 2]
"""

from __future__ import annotations

import argparse
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
    collate,
    eval_model,
    random_game_examples,
    train_supervised,
)
from services.envs.tictactoe import best_moves  # noqa: E402


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
    data = [ex for g in range(args.games)
            for ex in random_game_examples(tokenizer, rng, args.seed * 1_000_003 + g, best_moves)]
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
