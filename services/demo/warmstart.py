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

It also holds the small in-process player used to measure that (and by
``tests/bench/rl_sweep.py``): batched sampling from the model with the logprob of
each sampled token as ``log_softmax(logits / T)``, the same as the engine.

CLI: ``python -m services.demo.warmstart OUT_DIR [--seed N] [--games N] [--epochs N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.demo.tiny_model import create_tiny_model
from services.envs.render import close_assistant_turn, render_user_turn
from services.envs.tictactoe import TicTacToe, legal_cells

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


def random_game_examples(tokenizer: Any, rng: random.Random, seed: int) -> list[Example]:
    """Play one random-vs-random game; return one example per role that moved."""
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
            legal = legal_cells(env.board)
            cell = rng.choice(legal)
            reply = digit_ids[cell]
            ex.targets.append((len(ex.tokens), sorted({digit_ids[c][0] for c in legal})))
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


# ---------------------------------------------------------------- in-process player


@torch.no_grad()
def generate(model: Any, prompts: list[list[int]], eos: int, pad_id: int, temperature: float,
             generator: torch.Generator, max_new_tokens: int = MAX_NEW_TOKENS,
             ) -> list[tuple[list[int], list[float]]]:
    """Sample a reply for each prompt (left-padded batch, no KV cache: the views are short).

    Returns (output_ids, output_logprobs) per prompt, stopping after eos; the
    logprob is log_softmax(logits / T) of the sampled token (T = 0: greedy,
    logprob under T = 1).
    """
    n = len(prompts)
    outs: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    seqs = [list(p) for p in prompts]
    active = list(range(n))
    for _ in range(max_new_tokens):
        if not active:
            break
        t = max(len(seqs[i]) for i in active)
        ids = torch.full((len(active), t), pad_id, dtype=torch.long)
        attn = torch.zeros((len(active), t), dtype=torch.long)
        for row, i in enumerate(active):
            ids[row, t - len(seqs[i]):] = torch.tensor(seqs[i])
            attn[row, t - len(seqs[i]):] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1].float()
        if temperature > 0:
            lp = torch.log_softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(-1)
        else:
            lp = torch.log_softmax(logits, dim=-1)
            tok = lp.argmax(-1)
        chosen = lp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        still = []
        for row, i in enumerate(active):
            tid = int(tok[row])
            outs[i].append(tid)
            logps[i].append(float(chosen[row]))
            seqs[i].append(tid)
            if tid != eos:
                still.append(i)
        active = still
    return list(zip(outs, logps, strict=True))


@dataclass
class ModelPlayer:
    """A model that plays in-process; ``version`` is recorded per generated turn."""

    name: str
    model: Any
    tokenizer: Any
    version: int = 0


@dataclass
class View:
    """One role's token-exact view: what a Sample is built from."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add(self, ids: list[int], generated: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += ids
        self.loss_mask += [1 if generated else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


@dataclass
class Episode:
    env: TicTacToe
    players: dict[str, ModelPlayer | str]  # role -> model, or a scripted player's name
    views: dict[str, View] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)
    illegal_by: str | None = None
    done: bool = False

    def __post_init__(self) -> None:
        self.views = {role: View() for role, p in self.players.items() if isinstance(p, ModelPlayer)}


def play_episodes(episodes: list[Episode], temperature: float, generator: torch.Generator,
                  rng: random.Random, max_new_tokens: int = MAX_NEW_TOKENS) -> None:
    """Play all episodes to the end, batching each model's turns across episodes."""
    loop = asyncio.new_event_loop()

    def apply(ep: Episode, role: str, reply: str) -> None:
        result = loop.run_until_complete(ep.env.step(role, reply))
        if result.done:
            ep.done = True
            ep.rewards = dict(result.rewards)
            if "illegal" in result.info:
                ep.illegal_by = role

    try:
        while True:
            pending = [ep for ep in episodes if not ep.done]
            if not pending:
                break
            by_model: dict[str, list[tuple[Episode, str]]] = {}
            models: dict[str, ModelPlayer] = {}
            for ep in pending:
                role = ep.env.current_role()
                player = ep.players[role]
                if isinstance(player, ModelPlayer):
                    by_model.setdefault(player.name, []).append((ep, role))
                    models[player.name] = player
                else:
                    apply(ep, role, ep.env.scripted_reply(role, player, rng))
            for name, turns in by_model.items():
                mp = models[name]
                tok = mp.tokenizer
                prompts = []
                for ep, role in turns:
                    ep.views[role].add(user_turn(tok, ep.env.observation(role)), generated=False)
                    prompts.append(ep.views[role].tokens)
                replies = generate(mp.model, prompts, tok.eos_token_id, tok.pad_token_id, temperature,
                                   generator, max_new_tokens)
                for (ep, role), (ids, lps) in zip(turns, replies, strict=True):
                    view = ep.views[role]
                    view.add(ids, generated=True, logprobs=lps)
                    view.add(close_assistant_turn(tok, ids), generated=False)
                    view.versions.append(mp.version)
                    apply(ep, role, tok.decode(ids, skip_special_tokens=True))
    finally:
        loop.close()


def eval_vs_scripted(player: ModelPlayer, games: int, temperature: float, seed: int,
                     opponent: str = "random") -> dict[str, float]:
    """Score vs a scripted player (win 1, draw .5, loss or illegal 0), half the games as each side."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    episodes = []
    for i in range(games):
        me, other = ("X", "O") if i % 2 == 0 else ("O", "X")
        episodes.append(Episode(TicTacToe({}, seed + i), {me: player, other: opponent}))
    was_training = player.model.training
    player.model.eval()
    play_episodes(episodes, temperature, gen, rng)
    player.model.train(was_training)
    scores = {"X": [], "O": []}
    moves = illegal = 0
    for i, ep in enumerate(episodes):
        me = "X" if i % 2 == 0 else "O"
        r = ep.rewards.get(me, 0.0)
        scores[me].append(0.0 if ep.illegal_by == me else (r + 1.0) / 2.0)
        moves += len(ep.views[me].versions)
        illegal += ep.illegal_by == me
    allscores = scores["X"] + scores["O"]
    return {"score": sum(allscores) / len(allscores), "score_X": sum(scores["X"]) / len(scores["X"]),
            "score_O": sum(scores["O"]) / len(scores["O"]), "legal_rate": 1.0 - illegal / max(moves, 1),
            "illegal_games": illegal / games}


# ---------------------------------------------------------------- warm-start


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
    total_steps = epochs * ((len(examples) + batch_size - 1) // batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, total_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1.0 - s / total_steps))
    model.train()
    order_rng = random.Random(seed + 1)
    for epoch in range(epochs):
        order = list(range(len(examples)))
        order_rng.shuffle(order)
        losses = []
        for b in range(0, len(order), batch_size):
            ids, attn, dist = collate([examples[i] for i in order[b:b + batch_size]],
                                      tokenizer.pad_token_id, vocab)
            loss = soft_cross_entropy(model(input_ids=ids, attention_mask=attn).logits[:, :-1], dist)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            losses.append(float(loss.detach()))
        if verbose:
            mass = legal_mass(model, heldout, tokenizer.pad_token_id)
            print(f"epoch {epoch + 1}/{epochs}: loss {sum(losses) / len(losses):.4f}, held-out probability "
                  f"on legal cells {mass:.4f} ({time.perf_counter() - start:.1f}s)", flush=True)
    torch.use_deterministic_algorithms(False)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stats = eval_vs_scripted(ModelPlayer("warmstart", model, tokenizer), eval_games, 1.0, seed + 7)
    stats.update({"seconds": time.perf_counter() - start, "examples": len(examples), "hidden": hidden,
                  "layers": layers, "epochs": epochs, "games": games, "seed": seed})
    (out / "warmstart.json").write_text(json.dumps(stats, indent=1))
    if verbose:
        print(f"legal-move rate {stats['legal_rate']:.4f} (temperature 1, {eval_games} games vs random); "
              f"score vs random {stats['score']:.3f}; {stats['seconds']:.1f}s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--games", type=int, default=DEFAULT_GAMES)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN)
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    parser.add_argument("--lr", type=float, default=DEFAULT_LR)
    args = parser.parse_args()
    warmstart(args.out_dir, seed=args.seed, games=args.games, epochs=args.epochs, hidden=args.hidden,
              layers=args.layers, lr=args.lr)


if __name__ == "__main__":
    main()
