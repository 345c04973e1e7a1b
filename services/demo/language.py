"""The language demo model: a tiny byte-level model warm-started to play guess-the-number, in range but slow.

``warmstart_guess(out_dir)`` creates the tiny Qwen3-architecture model and byte-level tokenizer of
``tiny_model.py`` (nothing is downloaded), plays synthetic dialogues of ``services.envs.guess_number``
(1-100, the answerer's feedback stating the range left, ``show_range``) with a *weak* scripted
guesser, renders the guesser's view token-exactly as the coordinator does (``ChatRenderer``: the
chat template's user turns, then the reply ids ``digits + eos``; docs/architecture.md §8) and trains
by supervised cross-entropy on the reply tokens only (the pieces of ``warmstart.py``).

The weak guesser uses the feedback but not well: every guess lies in the range the answers allow
(the feedback states it, zero-padded: ``show_range``, ``pad_range``), drawn from a mixture
(``DEFAULT_MIX``) of uniform in that range, near its midpoint with noise, and towards one of its ends
(nearly a linear scan). Each reply token's target is the exact conditional distribution of that
guesser over numbers (a soft label: the first digit's marginal, each next digit or eos given the
digits so far), not a sampled number. That guesser finds the number within 16 turns 96 % of the
time, in 8.9 guesses (binary search: 5.8, at most 7). Measured at the defaults (hidden 128,
2 layers, 1500 games x 4 epochs; 200 held-out games at temperature 1): found within 16 turns 92 %,
9.35 guesses when found, 0.4 % of replies malformed (hidden 64: found 68.5 %, 9.64, 2.7 %: it uses
the range less well). Reinforcement learning has to find that guesses near the midpoint pay
(``tests/bench/guess_sweep.py`` measures it; ``configs/guess_demo.yaml`` runs it with ``tandem up``):
GRPO with the environment's shaping ``info_shaping`` and a KL term to this start brings the mean
guesses when found from 9.35 to 8.3 in 60 steps on 3 seeds (docs/results/language_demos.md).

CLI: ``tandem init-demo --task guess models/demo-guess`` or
``python -m services.demo.language OUT_DIR [--seed N] [--games N] [--epochs N]``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.contracts.config import EnvironmentConfig
from services.contracts.messages import SamplingParams
from services.contracts.players import AgentPlayer, Player
from services.demo.tiny_model import create_tiny_model
from services.demo.warmstart import Example, collate, train_supervised, warmstart_parser
from services.envs.base import Environment
from services.envs.guess_number import GuessNumber
from services.envs.render import ChatRenderer
from services.inference.generator import Engine
from services.play.episode import EpisodeResult
from services.play.evaluation import play_eval
from services.play.local import EnginePlayers

GUESS_PARAMS: dict[str, Any] = {"low": 1, "high": 100, "max_turns": 16, "turn_cost": 0.05,
                                "format_penalty": 0.2, "show_range": True, "pad_range": True,
                                "system": {"guesser": ""}}  # the tiny model plays without a system message
DEFAULT_MIX = (0.25, 0.25, 0.5)  # uniform in the range left, near its midpoint, towards an end
MID_SPREAD = 0.15
END_SCALE = 0.05
DEFAULT_HIDDEN = 128
DEFAULT_LAYERS = 2
DEFAULT_GAMES = 1500
DEFAULT_EPOCHS = 4
DEFAULT_LR = 2e-3
DEFAULT_BATCH = 8
MAX_NEW_TOKENS = 5
EOS = "<eos>"


# ---------------------------------------------------------------- the weak guesser


def guess_distribution(lo: int, hi: int, mix: tuple[float, float, float] = DEFAULT_MIX) -> dict[int, float]:
    """The weak guesser's probability of each number, all of it inside [lo, hi] (the range the answers
    allow): a mixture, weights ``mix``, of uniform on [lo, hi], near the midpoint (a normal of standard
    deviation ``MID_SPREAD`` x the width, cut to the range) and biased towards an end (each end half,
    decaying exponentially inwards with scale ``END_SCALE`` x the width)."""
    if not lo <= hi:
        raise ValueError(f"empty range {lo}-{hi}")
    numbers = range(lo, hi + 1)
    width = hi - lo + 1
    mid, spread, scale = (lo + hi) / 2, max(MID_SPREAD * width, 0.5), max(END_SCALE * width, 0.5)
    near = [math.exp(-0.5 * ((n - mid) / spread) ** 2) for n in numbers]
    ends = [math.exp(-(n - lo) / scale) + math.exp(-(hi - n) / scale) for n in numbers]
    z_near, z_ends = sum(near), sum(ends)
    w_uniform, w_mid, w_end = (w / sum(mix) for w in mix)
    return {n: w_uniform / width + w_mid * near[i] / z_near + w_end * ends[i] / z_ends
            for i, n in enumerate(numbers)}


def next_char_distribution(dist: dict[int, float], prefix: str) -> dict[str, float]:
    """The distribution of the character after ``prefix`` (``EOS`` when the number ends) of a number
    drawn from ``dist``, given that its decimal string starts with ``prefix``."""
    out: dict[str, float] = {}
    for n, p in dist.items():
        s = str(n)
        if p > 0 and s.startswith(prefix):
            c = s[len(prefix)] if len(s) > len(prefix) else EOS
            out[c] = out.get(c, 0.0) + p
    total = sum(out.values())
    return {c: p / total for c, p in out.items()}


def sample_guess(dist: dict[int, float], rng: random.Random) -> int:
    numbers = list(dist)
    return rng.choices(numbers, weights=[dist[n] for n in numbers])[0]


# ---------------------------------------------------------------- supervised data


def _char_ids(tokenizer: Any) -> dict[str, int]:
    ids = {str(d): tokenizer.encode(str(d), add_special_tokens=False) for d in range(10)}
    if any(len(v) != 1 for v in ids.values()):
        raise ValueError("the guess demo needs a tokenizer with one token per digit (a byte-level one)")
    return {**{c: v[0] for c, v in ids.items()}, EOS: tokenizer.eos_token_id}


def reply_targets(tokenizer: Any, dist: dict[int, float], guess: int, start: int,
                  ) -> tuple[list[int], list[tuple[int, list[tuple[int, float]]]]]:
    """The reply ids of ``guess`` (digits + eos) placed at ``start`` and, per reply position, its soft
    target [(token id, probability)]."""
    chars = _char_ids(tokenizer)
    text = str(guess)
    reply = [chars[c] for c in text] + [chars[EOS]]
    targets = []
    for i in range(len(reply)):
        cond = next_char_distribution(dist, text[:i])
        targets.append((start + i, [(chars[c], p) for c, p in sorted(cond.items())]))
    return reply, targets


def dialogue_example(tokenizer: Any, rng: random.Random, seed: int,
                     mix: tuple[float, float, float] = DEFAULT_MIX, params: dict[str, Any] | None = None,
                     ) -> tuple[Example, list[list[tuple[int, float]]]]:
    """Play one game of the weak guesser; the guesser's token-exact view and its soft targets.

    Returns ``(example, weights)``: ``example.targets[k] = (position, ids)`` and ``weights[k]`` the
    probabilities of those ids (``collate_soft`` puts them in)."""
    env = GuessNumber(params or GUESS_PARAMS, seed)
    renderer = ChatRenderer(tokenizer, env.system_prompt("guesser"))
    ex, weights = Example([], []), []
    loop = asyncio.new_event_loop()
    try:
        while True:
            ex.tokens += renderer.user_turn(env.observation("guesser"))
            dist = guess_distribution(env.lo, env.hi, mix)
            guess = sample_guess(dist, rng)
            reply, targets = reply_targets(tokenizer, dist, guess, len(ex.tokens))
            for pos, soft in targets:
                ex.targets.append((pos, [t for t, _ in soft]))
                weights.append([p for _, p in soft])
            ex.tokens += reply
            renderer.assistant_turn(reply)
            if loop.run_until_complete(env.step("guesser", str(guess))).done:
                break
    finally:
        loop.close()
    return ex, weights


def collate_soft(batch: list[tuple[Example, list[list[tuple[int, float]] | list[float]]]], pad_id: int,
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``warmstart.collate`` with the soft targets' own probabilities instead of uniform ones."""
    ids, attn, dist = collate([ex for ex, _ in batch], pad_id, vocab)
    dist.zero_()
    for i, (ex, weights) in enumerate(batch):
        for (pos, targets), probs in zip(ex.targets, weights, strict=True):
            dist[i, pos - 1, targets] = torch.tensor(probs, dtype=torch.float32)
    return ids, attn, dist


# ---------------------------------------------------------------- evaluation


def guess_stats(results: list[EpisodeResult], max_turns: int) -> dict[str, float]:
    """Mean guesses (± standard error) of the games that found the number, the failure rate (not found
    within ``max_turns``), format failures per game and per reply, mean turns (a game not found counts
    ``max_turns``) and mean reward."""
    found = [r.summary["turns"] for r in results if r.summary.get("found")]
    n = max(len(found), 1)
    mean = sum(found) / n
    var = sum((x - mean) ** 2 for x in found) / max(len(found) - 1, 1)
    return {"games": len(results), "mean_guesses": mean, "se_guesses": (var / n) ** 0.5,
            "fail_rate": 1.0 - len(found) / max(len(results), 1),
            "format_per_game": sum(r.summary.get("malformed", 0) for r in results) / max(len(results), 1),
            "format_rate": (sum(r.summary.get("malformed", 0) for r in results)
                            / max(sum(r.summary["turns"] for r in results), 1)),
            "mean_turns": sum(r.summary["turns"] for r in results) / max(len(results), 1),
            "max_turns": max_turns,
            "mean_reward": sum(r.rewards.get("guesser", 0.0) for r in results) / max(len(results), 1)}


async def eval_guesser(players: EnginePlayers, agent: str, games: int, temperature: float,
                       params: dict[str, Any] | None = None) -> dict[str, float]:
    """``guess_stats`` of ``agent`` over ``games`` seeded held-out games (services/play's evaluation)."""
    params = params or GUESS_PARAMS
    env_cfg = EnvironmentConfig(name="guess_number", params=params, roles={"guesser": agent})
    player = AgentPlayer(agent=agent)

    async def play(env: Environment, gid: str, roles: dict[str, Player], sampling: dict[Player, SamplingParams],
                   rng: random.Random) -> EpisodeResult:
        return await players.play(env, gid, gid, roles, sampling, "eval", rng)

    results = await play_eval(GuessNumber, env_cfg, player, ["guesser"], "bisect", games,
                              SamplingParams(max_new_tokens=MAX_NEW_TOKENS), temperature, play)
    return guess_stats([r for _, r in results], int(params["max_turns"]))


def eval_guess_model(model_dir: str | Path, games: int, temperature: float) -> dict[str, float]:
    threads = torch.get_num_threads()
    players = EnginePlayers({"guess": Engine(model_dir)})  # one thread: a tiny model only spins on more
    try:
        return asyncio.run(eval_guesser(players, "guess", games, temperature))
    finally:
        players.stop()
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- warm-start


def warmstart_guess(out_dir: str | Path, seed: int = 0, games: int = DEFAULT_GAMES, epochs: int = DEFAULT_EPOCHS,
                    hidden: int = DEFAULT_HIDDEN, layers: int = DEFAULT_LAYERS, lr: float = DEFAULT_LR,
                    batch_size: int = DEFAULT_BATCH, mix: tuple[float, float, float] = DEFAULT_MIX,
                    eval_games: int = 200,
                    verbose: bool = True) -> Path:
    """Create, train and save the warm-started guess-the-number model in ``out_dir``; return the path."""
    start = time.perf_counter()

    def log(msg: str) -> None:
        if verbose:
            print(f"{msg} ({time.perf_counter() - start:.1f}s)", flush=True)

    out = create_tiny_model(out_dir, seed=seed, hidden=hidden, layers=layers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only spin (15x slower on a loaded 2-core machine)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    rng = random.Random(seed)
    data = [dialogue_example(tokenizer, rng, seed * 1_000_003 + g, mix) for g in range(games)]
    log(f"{games} synthetic dialogues, {sum(len(ex.tokens) for ex, _ in data)} tokens")
    vocab = model.config.vocab_size
    losses = train_supervised(model, data, lambda batch: collate_soft(batch, tokenizer.pad_token_id, vocab),
                              epochs, lr, batch_size, seed, lambda e, v: log(f"epoch {e + 1}/{epochs}: loss {v:.4f}"))
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stats: dict[str, Any] = dict(eval_guess_model(out, eval_games, 1.0)) if eval_games else {}
    stats.update({"seconds": time.perf_counter() - start, "train_games": games, "epochs": epochs, "hidden": hidden,
                  "layers": layers, "mix": list(mix), "seed": seed, "final_loss": losses[-1],
                  "params": GUESS_PARAMS})
    (out / "warmstart.json").write_text(json.dumps(stats, indent=1))
    if eval_games:
        log(f"held-out ({eval_games} games, temperature 1): mean guesses {stats.get('mean_guesses', 0):.2f}, "
            f"not found in {GUESS_PARAMS['max_turns']}: {stats.get('fail_rate', 0):.3f}, "
            f"format failures per game {stats.get('format_per_game', 0):.3f}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = warmstart_parser(__doc__.split("\n")[0], DEFAULT_GAMES, DEFAULT_EPOCHS, DEFAULT_HIDDEN, DEFAULT_LAYERS,
                              DEFAULT_LR)
    parser.add_argument("--mix", type=float, nargs=3, default=list(DEFAULT_MIX), metavar=("UNIFORM", "MID", "END"),
                        help="the synthetic guesser's mixture: uniform in the range left, near its midpoint, "
                        "towards an end")
    parser.add_argument("--eval-games", type=int, default=200)
    args = parser.parse_args(argv)
    warmstart_guess(args.out_dir, seed=args.seed, games=args.games, epochs=args.epochs, hidden=args.hidden,
                    layers=args.layers, lr=args.lr, mix=tuple(args.mix), eval_games=args.eval_games)


if __name__ == "__main__":
    main()
