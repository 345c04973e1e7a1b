"""Start-model table: how a real chat model plays each language environment before any training.

For each environment, its config (``configs/<env>.yaml``) gives the parameters, the roles and each agent's
``max_new_tokens``; every agent (trained or frozen) is played by the one model (``--model``, in process on the
inference library's ``Engine``), scripted roles keep their scripted player. Two passes:

* greedy (temperature 0): ``--greedy`` episodes on distinct seeds;
* sampled (temperature 1): ``--groups`` groups of ``--group-size`` episodes, each group one seed (the
  environment's ``make_group``: what a GRPO group sees).

Per model role it reports the malformed rate (the share of its replies the environment found illegal or
malformed), the mean reward, and for the sampled pass the share of zero-variance groups (all of the group's
rewards to that role equal: no learning signal); per environment the means of its own measures
(``summary_measures``). Writes JSON (``--out``) and prints a Markdown table.

    PYTHONPATH=$PWD python tests/bench/start_table.py --model /work/models/smollm2-135m-instruct \\
        --envs math,guess_number --greedy 8 --groups 4 --out build/start_table.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from services.contracts.config import EnvironmentConfig, load_config  # noqa: E402
from services.contracts.messages import SamplingParams  # noqa: E402
from services.contracts.players import AgentPlayer, Player, Scripted  # noqa: E402
from services.envs.registry import load_environment  # noqa: E402
from services.inference.generator import Engine  # noqa: E402
from services.play.episode import EpisodeResult  # noqa: E402
from services.play.evaluation import summary_means  # noqa: E402
from services.play.local import EnginePlayers  # noqa: E402

ENVS = ("twenty_questions", "answer_then_answer", "debate", "doctor_patient", "support_desk", "explore_exploit",
        "guess_number", "math", "code")
OVERRIDES: dict[str, dict[str, Any]] = {}  # --set ENV.PARAM=VALUE: fewer turns for a quicker table
CHAT_TOKENS = {"code": 96}  # a chat model's function in a fence needs more than the demo config's limit


def setup(name: str, min_tokens: int = 0) -> tuple[EnvironmentConfig, dict[str, Player], dict[str, int]]:
    """The environment's config, its roles with every agent replaced by the model (one player per role, named
    after it, all on the one engine), each model role's token limit: the config's (set for the tiny demo
    model), at least ``min_tokens`` (``CHAT_TOKENS`` for the environments whose replies are longer)."""
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    env = cfg.environment.model_copy(update={"params": {**cfg.environment.params, **OVERRIDES.get(name, {})}})
    roles: dict[str, Player] = {}
    tokens: dict[str, int] = {}
    for role, player in env.roles.items():
        if isinstance(player, AgentPlayer):
            roles[role] = AgentPlayer(agent=role)
            tokens[role] = max(cfg.agents[player.agent].sampling.max_new_tokens, min_tokens, CHAT_TOKENS.get(name, 0))
        else:
            roles[role] = player
    return env, roles, tokens


async def play(players: EnginePlayers, name: str, seed: int, copies: int, temperature: float, min_tokens: int,
               ) -> list[EpisodeResult]:
    """``copies`` episodes of one seed (a group at temperature 1, one greedy episode at 0), played at once."""
    env_cfg, roles, tokens = setup(name, min_tokens)
    cls = load_environment(env_cfg.name)
    envs = cls.make_group(env_cfg.params, seed, copies)

    def sampling(i: int) -> dict[Player, SamplingParams]:
        return {AgentPlayer(agent=r): SamplingParams(temperature=temperature, max_new_tokens=n,
                                                     seed=seed * 100 + i) for r, n in tokens.items()}
    out = await asyncio.gather(*(players.play(e, f"{name}-{seed}-{i}", f"{name}-{seed}", roles, sampling(i),
                                              "eval", random.Random(seed)) for i, e in enumerate(envs)))
    return list(out)


def role_stats(results: list[EpisodeResult], role: str) -> dict[str, Any]:
    replies = bad = 0
    for r in results:
        n, b = r.replies(role)
        replies, bad = replies + n, bad + b
    rewards = [r.rewards.get(role, 0.0) for r in results]
    return {"replies": replies, "malformed_rate": bad / replies if replies else None,
            "mean_reward": sum(rewards) / len(rewards) if rewards else None}


async def measure(players: EnginePlayers, name: str, greedy: int, groups: int, size: int, min_tokens: int,
                  ) -> dict[str, Any]:
    env_cfg, roles, tokens = setup(name, min_tokens)
    cls = load_environment(env_cfg.name)
    model_roles = [r for r, p in roles.items() if not isinstance(p, Scripted)]
    t0 = time.time()  # every episode of a pass at once: the engine batches their turns
    g = [ep for eps in await asyncio.gather(*(play(players, name, 10_000 + i, 1, 0.0, min_tokens)
                                              for i in range(greedy))) for ep in eps]
    t1 = time.time()
    grouped = list(await asyncio.gather(*(play(players, name, 20_000 + k, size, 1.0, min_tokens)
                                          for k in range(groups))))
    t2 = time.time()
    s = [ep for grp in grouped for ep in grp]
    out: dict[str, Any] = {"env": name, "roles": {}, "greedy_s": round(t1 - t0, 1), "sampled_s": round(t2 - t1, 1),
                           "tokens": tokens, "scripted": {r: str(p) for r, p in roles.items() if r not in model_roles}}
    for role in model_roles:
        flat = sum(1 for grp in grouped if len({round(ep.rewards.get(role, 0.0), 9) for ep in grp}) == 1)
        out["roles"][role] = {"greedy": role_stats(g, role), "sampled": role_stats(s, role),
                              "zero_variance_groups": flat / len(grouped) if grouped else None}
    measures = cls.summary_measures
    first = model_roles[0]
    out["greedy_measures"] = summary_means([r.summary for r in g], measures, [first] * len(g))
    out["sampled_measures"] = summary_means([r.summary for r in s], measures, [first] * len(s))
    out["example"] = [{"role": t["role"], "text": t.get("text", "")[:100], "invalid": t.get("invalid")}
                      for t in (g[0].transcript if g else [])[:6]]
    return out


def fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| environment | role | malformed (greedy) | malformed (T=1) | zero-variance groups (T=1) | "
             "mean reward (greedy / T=1) | the environment's measures (greedy; T=1) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        for i, (role, st) in enumerate(row["roles"].items()):
            measures = "" if i else (", ".join(f"{k} {fmt(v)}" for k, v in row["greedy_measures"].items()) + "; "
                                     + ", ".join(f"{k} {fmt(v)}" for k, v in row["sampled_measures"].items()))
            lines.append(f"| {row['env'] if not i else ''} | {role} | {fmt(st['greedy']['malformed_rate'])} | "
                         f"{fmt(st['sampled']['malformed_rate'])} | {fmt(st['zero_variance_groups'])} | "
                         f"{fmt(st['greedy']['mean_reward'])} / {fmt(st['sampled']['mean_reward'])} | {measures} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    engine = Engine(args.model, max_batch=64)
    rows = []
    try:
        for name in args.envs.split(","):
            players = EnginePlayers({r: engine for r in setup(name)[2]})  # every model role on the one engine
            row = await measure(players, name, args.greedy, args.groups, args.group_size, args.min_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        engine.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/work/models/smollm2-135m-instruct")
    p.add_argument("--envs", default=",".join(ENVS))
    p.add_argument("--greedy", type=int, default=8, help="greedy episodes per environment")
    p.add_argument("--groups", type=int, default=4, help="sampled groups per environment")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=16, help="each model role's max_new_tokens at least this")
    p.add_argument("--out", default=str(REPO / "build" / "start_table.json"))
    p.add_argument("--set", action="append", default=[], metavar="ENV.PARAM=INT",
                   help="an environment parameter over its config's, e.g. twenty_questions.max_questions=4")
    args = p.parse_args()
    for item in args.set:
        key, _, value = item.partition("=")
        env, _, param = key.partition(".")
        OVERRIDES.setdefault(env, {})[param] = int(value)
    rows = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "greedy": args.greedy, "groups": args.groups,
                                          "group_size": args.group_size, "min_tokens": args.min_tokens,
                                          "overrides": OVERRIDES,
                                          "rows": rows}, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
