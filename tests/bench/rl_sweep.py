"""In-process simulation of Tandem's tic-tac-toe demo, to pick hyperparameters that make RL work.

Two agents A and B, each a ``TorchPolicy`` on its own copy of the warm-started model with an
in-process inference ``Engine`` serving its weights, play each other through services/play, the
way the distributed system does: per step, ``groups_per_batch`` groups of G games from one start
(``make_group``), sides alternating per group, every episode played by ``play_episode`` (the
coordinator's loop, renderer and sampler; moves sampled at temperature 1, each turn seeded).
Each agent's ``Sample``s (``EpisodeResult.samples``, group sizes counted as the coordinator
counts them) go through ``TorchPolicy.train_step``; the new weights are saved and loaded into
the agent's engine as the next version, as the trainer and rollout do.

``--matchups`` plays the coordinator's own schedule instead (``environment.matchups``, cycled over
the run's groups with seats alternating: config.py ``group_roles``), e.g.
``--matchups X=A,O=B X=A,O=scripted:minimax X=scripted:minimax,O=B``.

``--train-vs`` mixes in groups against the env's scripted players (cycled over a step's groups:
``partner`` is the A-vs-B game, ``minimax`` or ``random`` a group in which one agent, A and B in
turn, plays that scripted player; only the agent's side is trained on), a training opponent pool
the two-agent demo config cannot express but which shows what a strong opponent teaches.

Both agents are scored before training and every ``--eval-every`` steps against each of
``--eval-opponents`` (default ``random`` and ``minimax``: perfect play, random tie-breaks) at each
of ``--eval-temps``, by services/play's held-out evaluation (``play_eval`` + ``score``: win 1, draw
.5, loss or illegal 0; half the games as X, half as O; the same seeded episodes every time): the
score with its standard error, wins/draws/losses, the illegal-move rate (episodes in which the
agent's reply was illegal) and its missed wins and blocks per game. ``--out`` keeps every evaluation;
``summarize`` below turns the runs of several seeds into the mean ± standard error across seeds of
each curve's start and end.

    python tests/bench/rl_sweep.py --model models/demo-ttt --steps 12 --groups 16 --minibatches 2 --seeds 0 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

from services.contracts.config import AgentConfig, AlgorithmConfig, EnvironmentConfig  # noqa: E402
from services.contracts.messages import Sample, SamplingParams  # noqa: E402
from services.contracts.players import AgentPlayer, Player, Scripted  # noqa: E402
from services.demo.warmstart import MAX_NEW_TOKENS  # noqa: E402
from services.envs.base import Environment  # noqa: E402
from services.envs.tictactoe import TicTacToe  # noqa: E402
from services.inference.generator import Engine  # noqa: E402
from services.play.episode import EpisodeResult, group_samples, group_scripted_rng  # noqa: E402
from services.play.evaluation import mean_se, play_eval, score  # noqa: E402
from services.play.local import EnginePlayers  # noqa: E402
from services.training.torch_backend import TorchPolicy  # noqa: E402

AGENTS = ("A", "B")
# Options added after callers (tests/bench/bench_system.py) built their own Namespace: read with ``opt``.
DEFAULTS: dict[str, Any] = {"train_vs": ["partner"], "matchups": [], "eval_opponents": ["random", "minimax"],
                            "entropy_coef": 0.0, "kl_coef": 0.0, "temperature": 1.0, "lr_scheduler": "constant",
                            "credit": "episode", "gamma": 1.0, "scripted_rng": "episode", "baseline": "group",
                            "stable_steps": 0, "min_lr_ratio": 0.0}


def opt(args: argparse.Namespace, name: str) -> Any:
    return getattr(args, name, DEFAULTS[name])


@lru_cache(maxsize=4)
def matchup_config(matchups: tuple[str, ...]) -> EnvironmentConfig:
    """``--matchups`` (each ``X=A,O=scripted:minimax``) as the environment config the coordinator reads."""
    maps = [dict(pair.split("=", 1) for pair in m.split(",")) for m in matchups]
    return EnvironmentConfig(name="tictactoe", roles={"X": "A", "O": "B"}, alternate_roles=True, matchups=maps)


def group_roles(args: argparse.Namespace, step: int, g: int) -> dict[str, Player]:
    """Group ``g``'s role map: A against B (sides alternating per group), or one agent against a scripted
    player (``--train-vs``, cycled over the groups; the agent and its side alternate)."""
    if opt(args, "matchups"):  # the coordinator's schedule (config.py group_roles), group index step * groups + g
        return matchup_config(tuple(opt(args, "matchups"))).group_roles(step * args.groups + g)
    pool = opt(args, "train_vs")
    kind = g % len(pool)
    other = pool[kind]
    n = step * len(range(kind, args.groups, len(pool))) + g // len(pool)  # its index among the run's groups of its kind
    a, b = AgentPlayer(agent="A"), AgentPlayer(agent="B")
    if other == "partner":
        return {"X": a, "O": b} if n % 2 == 0 else {"X": b, "O": a}
    me = AgentPlayer(agent=AGENTS[n % 2])
    return {"X": me, "O": Scripted(name=other)} if (n // 2) % 2 == 0 else {"X": Scripted(name=other), "O": me}


async def play_step(players: EnginePlayers, args: argparse.Namespace, seed: int, step: int,
                    ) -> list[tuple[str, EpisodeResult]]:
    """All groups of one step at once; (group id, result) per episode."""
    openings = args.opening_moves if isinstance(args.opening_moves, list) else [args.opening_moves]
    jobs = []
    for g in range(args.groups):
        k = openings[(step * args.groups + g) % len(openings)]
        params = {**{k: json.loads(v) for k, v in (kv.split("=", 1) for kv in getattr(args, "env_param", []))},
                  **({"opening_moves": k} if k else {})}
        roles = group_roles(args, step, g)
        env_seed = seed * 1_000_000 + step * 1000 + g
        for n, env in enumerate(TicTacToe.make_group(params, env_seed, args.G)):
            episode_seed = (env_seed * 100 + n) % 2**62
            sampling: dict[Player, SamplingParams] = {
                p: SamplingParams(temperature=opt(args, "temperature"), max_new_tokens=MAX_NEW_TOKENS,
                                  seed=episode_seed) for p in roles.values() if isinstance(p, AgentPlayer)}
            gid = f"s{step}-g{g}"
            jobs.append((gid, players.play(env, f"{gid}-e{n}", gid, roles, sampling, "train",
                                           group_scripted_rng(env_seed) if opt(args, "scripted_rng") == "group"
                                           else random.Random(episode_seed))))
    results = await asyncio.gather(*(j for _, j in jobs))
    return [(gid, r) for (gid, _), r in zip(jobs, results, strict=True)]


def build_samples(results: list[tuple[str, EpisodeResult]]) -> dict[str, list[Sample]]:
    """Each group's samples, with the group sizes the coordinator gives them (an agent that never moved,
    after its opponent's illegal first move, has nothing to learn from and is skipped)."""
    out: dict[str, list[Sample]] = {a: [] for a in AGENTS}
    groups: dict[str, list[EpisodeResult]] = {}
    for gid, r in results:
        groups.setdefault(gid, []).append(r)
    for done in groups.values():
        counts = group_samples(done, AGENTS)
        for r in done:
            for sample in r.samples(counts):
                out[sample.agent].append(sample)
    return out


async def score_agent(players: EnginePlayers, agent: str, opponent: str, games: int, temperature: float,
                      ) -> dict[str, Any]:
    """``agent`` against the scripted ``opponent``: services/play's evaluation report (``score``)."""
    env_cfg = EnvironmentConfig(name="tictactoe", roles={"X": agent, "O": agent}, alternate_roles=True)

    async def play(env: Environment, gid: str, roles: dict[str, Player], sampling: dict[Player, SamplingParams],
                   rng: random.Random) -> EpisodeResult:
        return await players.play(env, gid, gid, roles, sampling, "eval", rng)

    results = await play_eval(TicTacToe, env_cfg, AgentPlayer(agent=agent), ["X", "O"], opponent, games,
                              SamplingParams(max_new_tokens=MAX_NEW_TOKENS), temperature, play)
    return score(results, ["X", "O"], opponent, TicTacToe.summary_measures)


async def evaluate(players: EnginePlayers, games: int, temps: list[float], opponents: list[str]) -> dict[str, Any]:
    """``agent@opponent@T`` -> score, its standard error, illegal rate and wins/draws/losses."""
    out = {}
    for name in AGENTS:
        for o in opponents:
            for t in temps:
                r = await score_agent(players, name, o, games, t)
                out[f"{name}@{o}@T{t:g}"] = {"score": round(r["score"], 4), "se": round(r["score_se"] or 0.0, 4),
                                             "illegal": round(r["illegal_rate"], 4),
                                             "wdl": [r["wins"], r["draws"], r["losses"]],
                                             "missed_wins_blocks": [round(r["summary_means"].get(k, 0.0), 3) for k in
                                                                    ("missed_wins", "missed_blocks")]}
    return out


async def run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    random.seed(seed)
    torch.manual_seed(seed)
    algo = AlgorithmConfig(lr=args.lr, clip_eps_low=args.clip, clip_eps_high=args.clip_high or args.clip,
                           epochs=args.epochs, minibatches=args.minibatches, max_grad_norm=args.max_grad_norm,
                           normalize_std=not args.no_std, entropy_coef=opt(args, "entropy_coef"),
                           kl_coef=opt(args, "kl_coef"), lr_scheduler=opt(args, "lr_scheduler"),
                           credit=opt(args, "credit"), gamma=opt(args, "gamma"), baseline=opt(args, "baseline"),
                           stable_steps=opt(args, "stable_steps"), min_lr_ratio=opt(args, "min_lr_ratio"),
                           decay_steps=max(args.steps * args.minibatches * args.epochs - opt(args, "stable_steps"), 1))
    policies = {name: TorchPolicy(AgentConfig(model_path=args.model, algorithm=algo, seed=seed + i),
                                  temperature=opt(args, "temperature")) for i, name in enumerate(AGENTS)}
    threads = torch.get_num_threads()
    players = EnginePlayers({name: Engine(args.model, weight_version=0) for name in AGENTS})
    torch.set_num_threads(threads)  # the engines ask for one thread; the trainers keep theirs
    temps = [float(t) for t in args.eval_temps]
    history: list[dict[str, Any]] = []
    weights = Path(tempfile.mkdtemp(prefix="rl_sweep_"))

    async def log_eval(step: int) -> None:
        await timed_eval(history, step, lambda: evaluate(players, args.eval_games, temps, opt(args, "eval_opponents")),
                         lambda ev: {"eval": ev})

    await log_eval(0)
    step_times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        results = await play_step(players, args, seed, step)
        t_gen = time.perf_counter() - t0
        samples = build_samples(results)
        metrics = {}
        for name, policy in policies.items():
            metrics[name] = policy.train_step(samples[name])
            path, _ = policy.save(weights / name)
            await players.engines[name].update_weights(str(path), policy.weight_version)
        t_step = time.perf_counter() - t0
        step_times.append(t_step)
        a_x = [r.rewards.get("X", 0.0) for _, r in results if r.roles["X"] == AgentPlayer(agent="A")]
        illegal = sum(bool(r.summary.get("illegal")) for _, r in results) / len(results)
        bad = {n: [bool(r.replies(role)[1]) for _, r in results for role, v in r.views.items() if v.agent == n]
               for n in AGENTS}
        print(json.dumps({
            "step": step + 1, "seconds": round(t_step, 2), "gen_s": round(t_gen, 2),
            "A_reward_as_X": round(sum(a_x) / max(len(a_x), 1), 3), "illegal_frac": round(illegal, 3),
            **{f"{n}_illegal": round(sum(xs) / max(len(xs), 1), 3) for n, xs in bad.items()},
            **{f"{n}_{k}": round(m[k], 4) for n, m in metrics.items()
               for k in ("reward_mean", "clip_frac", "grad_norm", "value_explained_var") if k in m}}), flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            await log_eval(step + 1)
    players.stop()
    return {"seed": seed, "history": history, "mean_step_seconds": sum(step_times) / len(step_times)}


def sweep_parser(description: str, steps: int) -> argparse.ArgumentParser:
    """The options every in-process sweep takes: the model, seeds, budget, group layout, lr and clip."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True, help="warm-started model directory")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--G", type=int, default=8, help="group size")
    ap.add_argument("--groups", type=int, default=4, help="groups per batch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=0.2)
    return ap


def main() -> None:
    ap = sweep_parser(__doc__.split("\n")[0], steps=20)
    ap.add_argument("--clip-high", type=float, default=0.0, help="0: same as --clip")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--minibatches", type=int, default=1)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--no-std", action="store_true", help="do not divide advantages by the group std")
    ap.add_argument("--opening-moves", type=int, nargs="+", default=[0],
                    help="random opening moves of each group, cycled over the run's groups (e.g. 0 2 4)")
    ap.add_argument("--eval-games", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-temps", nargs="+", default=["1", "0"])
    ap.add_argument("--eval-opponents", nargs="+", default=DEFAULTS["eval_opponents"])
    ap.add_argument("--train-vs", nargs="+", default=DEFAULTS["train_vs"],
                    choices=["partner", *TicTacToe.scripted_players],
                    help="training opponents cycled over a step's groups (partner: A vs B)")
    ap.add_argument("--matchups", nargs="+", default=[], help="environment.matchups, each X=A,O=scripted:minimax "
                    "(cycled over the run's groups, seats alternating; replaces --train-vs)")
    ap.add_argument("--env-param", nargs="+", default=[], help="environment.params for training, key=value")
    ap.add_argument("--credit", choices=["episode", "turn"], default="episode", help="algorithm.credit")
    ap.add_argument("--gamma", type=float, default=1.0, help="algorithm.gamma (credit: turn)")
    ap.add_argument("--entropy-coef", type=float, default=0.0)
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--temperature", type=float, default=1.0, help="training sampling temperature")
    ap.add_argument("--scripted-rng", default="episode", choices=["episode", "group"],
                    help="environment.scripted_rng: one random stream per episode or per group")
    ap.add_argument("--lr-scheduler", default="constant", choices=["constant", "linear", "cosine"])
    ap.add_argument("--stable-steps", type=int, default=0, help="algorithm.stable_steps (optimizer steps); the decay "
                    "runs over the rest")
    ap.add_argument("--min-lr-ratio", type=float, default=0.0, help="algorithm.min_lr_ratio")
    ap.add_argument("--baseline", default="group", choices=["group", "value"], help="algorithm.baseline")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    print_summary(run_seeds(ap.parse_args(), run))


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per ``agent@opponent@T``: the start and end score and the end illegal rate, mean ± standard error
    across the seeds' runs (``run``'s results)."""
    out: dict[str, dict[str, Any]] = {}
    for key in results[0]["history"][0]["eval"]:
        row: dict[str, Any] = {}
        for when, idx in (("start", 0), ("end", -1)):
            for field in ("score", "illegal"):
                m, se = mean_se([r["history"][idx]["eval"][key][field] for r in results])
                row[f"{when}_{field}"] = (round(m, 3) if m is not None else None,
                                          round(se, 3) if se is not None else None)
        out[key] = row
    return out


def print_summary(results: list[dict[str, Any]]) -> None:
    if not results:
        return
    print(f"== summary over {len(results)} seed(s): mean ± SE across seeds ==", flush=True)
    for key, row in summarize(results).items():
        (s0, e0), (s1, e1), (i1, _) = row["start_score"], row["end_score"], row["end_illegal"]
        print(f"{key:22s} start {s0:.3f} ± {e0 or 0:.3f}  end {s1:.3f} ± {e1 or 0:.3f}  end illegal {i1:.3f}",
              flush=True)


async def timed_eval(history: list[dict[str, Any]], step: int, evaluate_now: Callable[[], Awaitable[Any]],
                     fields: Callable[[Any], dict[str, Any]]) -> None:
    """Evaluate now, and log and keep the row: the step, the seconds it took and ``fields`` of the result."""
    t0 = time.perf_counter()
    ev = await evaluate_now()
    row = {"step": step, "eval_seconds": round(time.perf_counter() - t0, 1), **fields(ev)}
    history.append(row)
    print(json.dumps(row), flush=True)


def run_seeds(args: argparse.Namespace, run_one: Callable[[argparse.Namespace, int], Awaitable[dict[str, Any]]]
              ) -> list[dict[str, Any]]:
    """Run ``run_one`` for each of ``args.seeds`` and write the results to ``args.out`` when given."""
    results = []
    for seed in args.seeds:
        print(f"== seed {seed} ==", flush=True)
        results.append(asyncio.run(run_one(args, seed)))
        print(f"mean step seconds {results[-1]['mean_step_seconds']:.2f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
