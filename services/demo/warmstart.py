"""Deterministic warm-start of the tiny demo model: legal but weak tic-tac-toe.

``warmstart(out_dir)`` creates the tiny model (``create_tiny_model``), plays
random-vs-random games of ``services.envs.tictactoe``, renders each role's
view exactly as the coordinator does (per turn: ``render_user_turn`` of the
role's observation, then the reply tokens ``encode(digit) + [eos]``), and
trains by supervised cross-entropy on the reply tokens only. The target of the
digit is the uniform distribution over the legal cells (the expected label of
a random player, without its sampling noise), the target after it is eos. The
result plays legal moves, uniformly at random: the starting point the RL demo
then improves on.

It is measured (and ``tests/bench/rl_sweep.py`` measures its agents) with
services/play's held-out evaluation on an in-process engine: the same episode
loop, renderer and sampler as a run.

CLI: ``python -m services.demo.warmstart OUT_DIR [--seed N] [--games N] [--epochs N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.contracts.config import EnvironmentConfig
from services.contracts.messages import SamplingParams
from services.contracts.players import AgentPlayer, Player
from services.demo.tiny_model import create_tiny_model
from services.envs.base import Environment
from services.envs.render import render_user_turn
from services.envs.tictactoe import TicTacToe, legal_cells
from services.inference.generator import Engine
from services.play.episode import EpisodeResult
from services.play.evaluation import play_eval, score
from services.play.local import EnginePlayers

DEFAULT_HIDDEN = 64
DEFAULT_LAYERS = 2
DEFAULT_GAMES = 1000
DEFAULT_EPOCHS = 6
DEFAULT_LR = 2e-3
DEFAULT_BATCH = 8
MAX_NEW_TOKENS = 4


@lru_cache(maxsize=65536)
def _rendered(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(render_user_turn(tokenizer, text))


def user_turn(tokenizer: Any, text: str) -> list[int]:
    """``render_user_turn`` with a cache (observations repeat a lot)."""
    return list(_rendered(tokenizer, text))


# ---------------------------------------------------------------- supervised data


@dataclass
class Example:
    """One role's view of one game; ``targets`` maps a position to its target token ids.

    The token at ``position`` is predicted from the logits at ``position - 1``;
    several ids mean a uniform target over them.
    """

    tokens: list[int]
    targets: list[tuple[int, list[int]]]


def legal_targets(board: str, role: str) -> list[int]:
    """The warm start's move targets: every legal cell (the expected label of a random player)."""
    return legal_cells(board)


def random_game_examples(tokenizer: Any, rng: random.Random, seed: int,
                         target_cells: Callable[[str, str], list[int]] = legal_targets) -> list[Example]:
    """Play one random-vs-random game; return one example per role that moved, each move's target the
    uniform distribution over ``target_cells(board, role)`` (tests/bench/ttt_capacity.py: minimax's best)."""
    env = TicTacToe({}, seed)
    eos = tokenizer.eos_token_id
    digit_ids = {c: tokenizer.encode(str(c), add_special_tokens=False) for c in range(1, 10)}
    examples = {role: Example([], []) for role in env.roles}
    loop = asyncio.new_event_loop()
    try:
        while True:
            role = env.current_role()
            ex = examples[role]
            ex.tokens += user_turn(tokenizer, env.observation(role))
            cell = rng.choice(legal_cells(env.board))
            reply = digit_ids[cell]
            ex.targets.append((len(ex.tokens), sorted({digit_ids[c][0] for c in target_cells(env.board, role)})))
            ex.tokens += reply
            ex.targets.extend((len(ex.tokens) - len(reply) + i, [t]) for i, t in enumerate(reply[1:], 1))
            ex.targets.append((len(ex.tokens), [eos]))
            ex.tokens.append(eos)
            if loop.run_until_complete(env.step(role, str(cell))).done:
                break
    finally:
        loop.close()
    return [ex for ex in examples.values() if ex.targets]


def collate(examples: list[Example], pad_id: int, vocab: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and target distributions [B, T-1, V] (zero rows = no loss)."""
    t = max(len(e.tokens) for e in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), t), dtype=torch.long)
    dist = torch.zeros((len(examples), t - 1, vocab), dtype=torch.float32)
    for i, e in enumerate(examples):
        ids[i, :len(e.tokens)] = torch.tensor(e.tokens)
        attn[i, :len(e.tokens)] = 1
        for pos, targets in e.targets:
            dist[i, pos - 1, targets] = 1.0 / len(targets)
    return ids, attn, dist


def soft_cross_entropy(logits: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """Mean over supervised positions of -sum_v q(v) log p(v)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    per_pos = -(dist * logp).sum(-1)
    supervised = dist.sum(-1) > 0
    return per_pos[supervised].mean()


@torch.no_grad()
def legal_mass(model: Any, examples: list[Example], pad_id: int, batch_size: int = 128) -> float:
    """Mean probability (T = 1) the model puts on the target set at the move positions (several ids)."""
    masses = []
    vocab = model.config.vocab_size
    for b in range(0, len(examples), batch_size):
        ids, attn, dist = collate(examples[b:b + batch_size], pad_id, vocab)
        probs = torch.softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), dim=-1)
        moves = (dist > 0).sum(-1) > 1
        masses.append(((dist > 0).float() * probs).sum(-1)[moves])
    return float(torch.cat(masses).mean())


# ---------------------------------------------------------------- evaluation


async def score_vs_scripted(players: EnginePlayers, agent: str, games: int, temperature: float,
                            opponent: str = "random", max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, float]:
    """Score of ``agent`` vs a scripted player (win 1, draw .5, loss or illegal 0), half the games as each
    side, played through services/play's held-out evaluation; plus its legal-move rate and its missed wins
    and blocks per game."""
    env_cfg = EnvironmentConfig(name="tictactoe", roles={"X": agent, "O": agent}, alternate_roles=True)
    player = AgentPlayer(agent=agent)

    async def play(env: Environment, gid: str, roles: dict[str, Player], sampling: dict[Player, SamplingParams],
                   rng: random.Random) -> EpisodeResult:
        return await players.play(env, gid, gid, roles, sampling, "eval", rng)

    results = await play_eval(TicTacToe, env_cfg, player, ["X", "O"], opponent, games,
                              SamplingParams(max_new_tokens=max_new_tokens), temperature, play)
    scores = score(results, ["X", "O"], opponent, TicTacToe.summary_measures)
    moves = sum(len(r.views[mine].weight_versions) for mine, r in results)
    illegal = sum(1 for mine, r in results if r.summary.get("illegal") and r.transcript[-1]["role"] == mine)
    return {"score": scores["score"], "score_X": scores["per_role"]["X"], "score_O": scores["per_role"]["O"],
            "legal_rate": 1.0 - illegal / max(moves, 1), "illegal_games": illegal / games,
            **scores["summary_means"]}


def eval_model(model_dir: str | Path, games: int, temperature: float, opponent: str = "random",
               ) -> dict[str, float]:
    """``score_vs_scripted`` of the model saved in ``model_dir``, on an in-process engine."""
    threads = torch.get_num_threads()
    players = EnginePlayers({"warmstart": Engine(model_dir)})
    torch.set_num_threads(threads)  # the engine asks for one thread; leave the caller's setting alone
    try:
        return asyncio.run(score_vs_scripted(players, "warmstart", games, temperature, opponent))
    finally:
        players.stop()


# ---------------------------------------------------------------- warm-start


def train_supervised(model: Any, data: list[Any], collate_fn: Callable[[list[Any]], tuple[torch.Tensor, ...]],
                     epochs: int, lr: float, batch_size: int, seed: int,
                     on_epoch: Callable[[int, float], None] | None = None) -> list[float]:
    """Soft cross-entropy by AdamW with warm-up and linear decay over ``data`` in seeded shuffled batches
    (``collate_fn`` makes ids, attention mask and target distributions); the per-epoch mean losses. Leaves the
    model in eval mode. Both demo models' warm starts train through it."""
    total_steps = epochs * ((len(data) + batch_size - 1) // batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, total_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1.0 - s / total_steps))
    model.train()
    order_rng = random.Random(seed + 1)
    epoch_losses = []
    for epoch in range(epochs):
        order = list(range(len(data)))
        order_rng.shuffle(order)
        losses = []
        for b in range(0, len(order), batch_size):
            ids, attn, dist = collate_fn([data[i] for i in order[b:b + batch_size]])
            loss = soft_cross_entropy(model(input_ids=ids, attention_mask=attn).logits[:, :-1], dist)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            losses.append(float(loss.detach()))
        epoch_losses.append(sum(losses) / len(losses))
        if on_epoch is not None:
            on_epoch(epoch, epoch_losses[-1])
    model.eval()
    return epoch_losses


def warmstart(out_dir: str | Path, seed: int = 0, games: int = DEFAULT_GAMES, epochs: int = DEFAULT_EPOCHS,
              hidden: int = DEFAULT_HIDDEN, layers: int = DEFAULT_LAYERS, lr: float = DEFAULT_LR,
              batch_size: int = DEFAULT_BATCH, eval_games: int = 400, verbose: bool = True) -> Path:
    """Create, train and save the warm-started model in ``out_dir``; return the path."""
    start = time.perf_counter()
    out = create_tiny_model(out_dir, seed=seed, hidden=hidden, layers=layers)
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    examples = [ex for g in range(games) for ex in random_game_examples(tokenizer, rng, seed * 1_000_003 + g)]
    heldout = [ex for g in range(100) for ex in random_game_examples(tokenizer, rng, -1 - g)]

    def report(epoch: int, loss: float) -> None:
        if verbose:
            mass = legal_mass(model, heldout, tokenizer.pad_token_id)
            print(f"epoch {epoch + 1}/{epochs}: loss {loss:.4f}, held-out probability "
                  f"on legal cells {mass:.4f} ({time.perf_counter() - start:.1f}s)", flush=True)

    train_supervised(model, examples, lambda batch: collate(batch, tokenizer.pad_token_id, vocab), epochs, lr,
                     batch_size, seed, report)
    torch.use_deterministic_algorithms(False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stats = eval_model(out, eval_games, 1.0)
    stats.update({"seconds": time.perf_counter() - start, "examples": len(examples), "hidden": hidden,
                  "layers": layers, "epochs": epochs, "games": games, "seed": seed})
    (out / "warmstart.json").write_text(json.dumps(stats, indent=1))
    if verbose:
        print(f"legal-move rate {stats['legal_rate']:.4f} (temperature 1, {eval_games} games vs random); "
              f"score vs random {stats['score']:.3f}; {stats['seconds']:.1f}s", flush=True)
    return out


def warmstart_parser(description: str, games: int, epochs: int, hidden: int, layers: int,
                     lr: float) -> argparse.ArgumentParser:
    """The warm-start command line the demo models share (each with its own defaults)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    for flag, kind, default in (("--games", int, games), ("--epochs", int, epochs), ("--hidden", int, hidden),
                                ("--layers", int, layers), ("--lr", float, lr)):
        parser.add_argument(flag, type=kind, default=default)
    return parser


def main() -> None:
    parser = warmstart_parser(__doc__.split("\n")[0], DEFAULT_GAMES, DEFAULT_EPOCHS, DEFAULT_HIDDEN, DEFAULT_LAYERS,
                              DEFAULT_LR)
    args = parser.parse_args()
    warmstart(args.out_dir, seed=args.seed, games=args.games, epochs=args.epochs, hidden=args.hidden,
              layers=args.layers, lr=args.lr)


if __name__ == "__main__":
    main()
