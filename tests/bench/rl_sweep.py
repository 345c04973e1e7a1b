"""In-process simulation of Tandem's tic-tac-toe demo, to pick hyperparameters that make RL work.

Two agents A and B, each a ``TorchPolicy`` on its own copy of the warm-started
model, play each other the way the distributed system will: per step,
``groups_per_batch`` groups of G games from one start (``make_group``), sides
alternating per group, moves sampled at temperature 1 with the logprob of each
sampled token taken as log_softmax(logits / T), each agent's view built turn by
turn with ``render_user_turn`` plus its generated tokens (plus a loss-masked
eos when the reply was cut short). Each agent's ``Sample``s go through
``TorchPolicy.train_step``; both agents are scored against the scripted random
player (win 1, draw .5, loss or illegal 0; half the games as X, half as O)
before training and every ``--eval-every`` steps.

    python tests/bench/rl_sweep.py --model models/demo-ttt --steps 12 --groups 16 --minibatches 2 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

from services.contracts.config import AgentConfig, AlgorithmConfig  # noqa: E402
from services.contracts.messages import Sample  # noqa: E402
from services.demo.warmstart import Episode, ModelPlayer, eval_vs_scripted, play_episodes  # noqa: E402
from services.envs.tictactoe import TicTacToe  # noqa: E402
from services.training.torch_backend import TorchPolicy  # noqa: E402


def build_samples(episodes: list[Episode], group_ids: list[str], group_size: int, step: int,
                  ) -> dict[str, list[Sample]]:
    """One Sample per (episode, trained agent); an agent that never moved (opponent's illegal first move)
    has nothing to learn from and is skipped, as the coordinator must."""
    out: dict[str, list[Sample]] = {}
    for n, (ep, gid) in enumerate(zip(episodes, group_ids, strict=True)):
        for role, player in ep.players.items():
            if not isinstance(player, ModelPlayer):
                continue
            view = ep.views[role]
            if not any(view.loss_mask):
                continue
            out.setdefault(player.name, []).append(Sample(
                agent=player.name, role=role, episode_id=f"s{step}-e{n}", group_id=gid,
                group_size=group_size, tokens=view.tokens, loss_mask=view.loss_mask,
                rollout_logprobs=view.logprobs, reward=ep.rewards.get(role, 0.0),
                turn_weight_versions=view.versions or [step]))
    return out


def evaluate(players: dict[str, ModelPlayer], games: int, temps: list[float], seed: int) -> dict[str, Any]:
    return {f"{name}@T{t:g}": eval_vs_scripted(p, games, t, seed)
            for name, p in players.items() for t in temps}


def run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    random.seed(seed)
    torch.manual_seed(seed)
    algo = AlgorithmConfig(lr=args.lr, clip_eps_low=args.clip, clip_eps_high=args.clip_high or args.clip,
                           epochs=args.epochs, minibatches=args.minibatches, max_grad_norm=args.max_grad_norm,
                           normalize_std=not args.no_std)
    policies = {name: TorchPolicy(AgentConfig(model_path=args.model, algorithm=algo, seed=seed + i), temperature=1.0)
                for i, name in enumerate(("A", "B"))}
    players = {name: ModelPlayer(name, p.model, p.tokenizer, version=0) for name, p in policies.items()}
    params = {"opening_moves": args.opening_moves} if args.opening_moves else {}
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    temps = [float(t) for t in args.eval_temps]
    history: list[dict[str, Any]] = []

    def log_eval(step: int) -> None:
        t0 = time.perf_counter()
        ev = evaluate(players, args.eval_games, temps, seed=10_000)
        row = {"step": step, "eval_seconds": time.perf_counter() - t0,
               **{k: round(v["score"], 3) for k, v in ev.items()},
               **{f"{k}_legal": round(v["legal_rate"], 3) for k, v in ev.items()}}
        history.append(row)
        print(json.dumps(row), flush=True)

    log_eval(0)
    step_times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        episodes: list[Episode] = []
        group_ids: list[str] = []
        for g in range(args.groups):
            a_role = "X" if (step * args.groups + g) % 2 == 0 else "O"
            b_role = "O" if a_role == "X" else "X"
            env_seed = seed * 1_000_000 + step * 1000 + g
            for env in TicTacToe.make_group(params, env_seed, args.G):
                episodes.append(Episode(env, {a_role: players["A"], b_role: players["B"]}))
                group_ids.append(f"s{step}-g{g}")
        play_episodes(episodes, 1.0, gen, rng)
        t_gen = time.perf_counter() - t0
        samples = build_samples(episodes, group_ids, args.G, step)
        metrics = {}
        for name, policy in policies.items():
            metrics[name] = policy.train_step(samples.get(name, []))
            players[name].version = step + 1
        t_step = time.perf_counter() - t0
        step_times.append(t_step)
        a_x = [ep.rewards.get("X", 0.0) for ep in episodes if ep.players["X"] is players["A"]]
        illegal = sum(ep.illegal_by is not None for ep in episodes) / len(episodes)
        print(json.dumps({
            "step": step + 1, "seconds": round(t_step, 2), "gen_s": round(t_gen, 2),
            "A_reward_as_X": round(sum(a_x) / max(len(a_x), 1), 3), "illegal_frac": round(illegal, 3),
            **{f"{n}_{k}": round(m[k], 4) for n, m in metrics.items()
               for k in ("reward_mean", "clip_frac", "grad_norm")}}), flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            log_eval(step + 1)
    return {"seed": seed, "history": history, "mean_step_seconds": sum(step_times) / len(step_times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="warm-started model directory")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--G", type=int, default=8, help="group size")
    ap.add_argument("--groups", type=int, default=4, help="groups per batch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--clip-high", type=float, default=0.0, help="0: same as --clip")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--minibatches", type=int, default=1)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--no-std", action="store_true", help="do not divide advantages by the group std")
    ap.add_argument("--opening-moves", type=int, default=0)
    ap.add_argument("--eval-games", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-temps", nargs="+", default=["1", "0"])
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args()
    results = []
    for seed in args.seeds:
        print(f"== seed {seed} ==", flush=True)
        results.append(run(args, seed))
        print(f"mean step seconds {results[-1]['mean_step_seconds']:.2f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
