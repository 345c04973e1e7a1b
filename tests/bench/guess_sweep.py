"""In-process RL of the guess-the-number demo model: does the mean number of guesses fall?

One agent, a ``TorchPolicy`` on the warm-started model (``services/demo/language.py``) with an
in-process inference ``Engine`` serving its weights, plays guess-the-number (1-100, feedback with
the range left) through services/play, the way the distributed system does: per step,
``--groups`` GRPO groups of G games from one seed (``make_group``: same hidden number), every
episode played by ``play_episode`` (the coordinator's loop, renderer and sampler; replies sampled
at temperature 1, each turn seeded); the samples (``EpisodeResult.samples``) go through
``TorchPolicy.train_step`` and the new weights are loaded into the engine as the next version.
Before training and every ``--eval-every`` steps the model plays the held-out evaluation
(services/play, seeded, temperature 1): mean guesses of the games that found the number ± SE, the
rate of games not found within the turn limit, format failures per game.

``--env KEY=VALUE`` changes the training games' params (the evaluation keeps the demo's), e.g. the
shaping ``info_shaping=0.2``; ``--kl`` adds the KL term to the warm start. The demo's recipe
(configs/guess_demo.yaml; README, "Guess the number"):

    python tests/bench/guess_sweep.py --model models/demo-guess --steps 60 --groups 8 --lr 3e-4 --kl 0.1
        --env info_shaping=0.2 --eval-every 20 --seeds 0 1 2 --out guess.json
    python tests/bench/guess_sweep.py summary guess.json    # start vs end, mean ± SE across seeds
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

from services.contracts.config import AgentConfig, AlgorithmConfig  # noqa: E402
from services.contracts.messages import Sample, SamplingParams  # noqa: E402
from services.contracts.players import AgentPlayer, Player  # noqa: E402
from services.demo.language import GUESS_PARAMS, MAX_NEW_TOKENS, eval_guesser, guess_stats  # noqa: E402
from services.envs.guess_number import GuessNumber  # noqa: E402
from services.inference.generator import Engine  # noqa: E402
from services.play.episode import EpisodeResult, group_samples  # noqa: E402
from services.play.local import EnginePlayers  # noqa: E402
from services.training.torch_backend import TorchPolicy  # noqa: E402
from tests.bench.rl_sweep import run_seeds, sweep_parser, timed_eval  # noqa: E402

AGENT = "A"


async def play_step(players: EnginePlayers, args: argparse.Namespace, seed: int, step: int,
                    ) -> list[tuple[str, EpisodeResult]]:
    """All groups of one step at once; (group id, result) per episode."""
    me = AgentPlayer(agent=AGENT)
    roles: dict[str, Player] = {"guesser": me}
    jobs = []
    for g in range(args.groups):
        env_seed = seed * 1_000_000 + step * 1000 + g
        for n, env in enumerate(GuessNumber.make_group(train_params(args), env_seed, args.G)):
            episode_seed = (env_seed * 100 + n) % 2**62
            sampling = {me: SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=episode_seed)}
            gid = f"s{step}-g{g}"
            jobs.append((gid, players.play(env, f"{gid}-e{n}", gid, roles, sampling, "train",
                                           random.Random(episode_seed))))
    results = await asyncio.gather(*(j for _, j in jobs))
    return [(gid, r) for (gid, _), r in zip(jobs, results, strict=True)]


def train_params(args: argparse.Namespace) -> dict[str, Any]:
    """The training games' environment params: the demo's, with ``--env KEY=VALUE`` overrides (e.g.
    ``info_shaping=0.1``); the held-out evaluation always plays the demo's own."""
    extra = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.env)}
    return {**GUESS_PARAMS, **extra}


def build_samples(results: list[tuple[str, EpisodeResult]]) -> list[Sample]:
    groups: dict[str, list[EpisodeResult]] = {}
    for gid, r in results:
        groups.setdefault(gid, []).append(r)
    out = []
    for done in groups.values():
        counts = group_samples(done, {AGENT})
        out += [s for r in done for s in r.samples(counts)]
    return out


async def run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    random.seed(seed)
    torch.manual_seed(seed)
    algo = AlgorithmConfig(name=args.algo, lr=args.lr, clip_eps_low=args.clip, credit=args.credit,
                           clip_eps_high=args.clip_high or args.clip, epochs=1,
                           minibatches=args.minibatches, kl_coef=args.kl,
                           entropy_coef=args.entropy)
    policy = TorchPolicy(AgentConfig(model_path=args.model, algorithm=algo, seed=seed + 1), temperature=1.0)
    players = EnginePlayers({AGENT: Engine(args.model, weight_version=0)})
    torch.set_num_threads(args.threads)  # the engine asks for one; more only spin on a tiny model
    history: list[dict[str, Any]] = []
    weights = Path(tempfile.mkdtemp(prefix="guess_sweep_"))

    async def log_eval(step: int) -> None:
        await timed_eval(history, step, lambda: eval_guesser(players, AGENT, args.eval_games, 1.0),
                         lambda ev: {k: round(v, 4) for k, v in ev.items()})

    await log_eval(0)
    step_times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        results = await play_step(players, args, seed, step)
        t_gen = time.perf_counter() - t0
        metrics = policy.train_step(build_samples(results))
        path, _ = policy.save(weights / AGENT)
        await players.engines[AGENT].update_weights(str(path), policy.weight_version)
        step_times.append(time.perf_counter() - t0)
        train = guess_stats([r for _, r in results], int(GUESS_PARAMS["max_turns"]))
        print(json.dumps({"step": step + 1, "seconds": round(step_times[-1], 1), "gen_s": round(t_gen, 1),
                          "train_mean_guesses": round(train["mean_guesses"], 2),
                          "train_mean_turns": round(train["mean_turns"], 2),
                          "train_fail": round(train["fail_rate"], 3), "train_format": train["format_per_game"],
                          **{k: round(metrics[k], 4) for k in ("reward_mean", "clip_frac", "grad_norm")}}),
              flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            await log_eval(step + 1)
    players.stop()
    return {"seed": seed, "history": history, "mean_step_seconds": sum(step_times) / max(len(step_times), 1)}


def summarize(paths: list[str]) -> dict[str, Any]:
    """Mean ± SE across seeds (each file one or more seeds' ``--out``) of the first and last evaluation:
    mean guesses of the games found, the rate not found, mean turns (a game not found counts the limit)."""
    rows = [r for p in paths for r in json.loads(Path(p).read_text())["results"]]
    out: dict[str, Any] = {"seeds": [r["seed"] for r in rows]}
    for key in ("mean_guesses", "fail_rate", "mean_turns", "format_per_game"):
        for when, index in (("start", 0), ("end", -1)):
            xs = [r["history"][index][key] for r in rows]
            mean = sum(xs) / len(xs)
            se = (sum((x - mean) ** 2 for x in xs) / max(len(xs) - 1, 1) / len(xs)) ** 0.5
            out[f"{key}_{when}"] = {"mean": round(mean, 3), "se": round(se, 3), "per_seed": xs}
    out["steps"] = [r["history"][-1]["step"] for r in rows]
    return out


def main() -> None:
    if sys.argv[1:2] == ["summary"]:  # guess_sweep.py summary seed0.json seed1.json ...
        print(json.dumps(summarize(sys.argv[2:]), indent=1))
        return
    ap = sweep_parser(__doc__.split("\n")[0], steps=30)
    ap.add_argument("--clip-high", type=float, default=0.28)
    ap.add_argument("--algo", default="grpo", help="algorithm.name (grpo, gspo, dr_grpo, ...)")
    ap.add_argument("--credit", default="episode", choices=["episode", "turn"], help="algorithm.credit")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="training environment params over the demo's, e.g. info_shaping=0.1 turn_cost=0.1")
    ap.add_argument("--minibatches", type=int, default=1)
    ap.add_argument("--kl", type=float, default=0.0)
    ap.add_argument("--entropy", type=float, default=0.0, help="entropy bonus coefficient")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (engine and trainer)")
    ap.add_argument("--eval-games", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", default="", help="write the results as JSON here")
    run_seeds(ap.parse_args(), run)


if __name__ == "__main__":
    main()
