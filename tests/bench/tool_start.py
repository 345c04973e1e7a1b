"""How a start model uses tools: play a tool environment's episodes with one model in every model role.

``python -m tests.bench.tool_start MODEL --env tool_math --episodes 8`` prints JSON: the mean reward per role,
the environment's summary means, and per model turn the share that called a tool, the calls that were
malformed or failed, and the seconds taken. Scripted players (``--scripted role=player``) fill other roles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from statistics import mean
from typing import Any

from services.contracts.messages import SamplingParams
from services.contracts.players import Local, Player, Scripted
from services.envs.registry import load_environment
from services.play.episode import play_episode
from services.play.local import LocalPlayers


async def measure(model: str, env_name: str, episodes: int, scripted: dict[str, str], params: dict[str, Any],
                  max_new_tokens: int, temperature: float) -> dict[str, Any]:
    env_cls = load_environment(env_name)
    players = LocalPlayers(max_batch=episodes)
    local = Local(path=model, agent="start")
    roles: dict[str, Player] = {r: Scripted(name=scripted[r]) if r in scripted else local for r in env_cls.roles}
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    started = time.monotonic()
    try:
        results = await asyncio.gather(*(play_episode(
            env_cls(params, seed), f"ep{seed}", f"g{seed}", roles, {local: players.tokenizer(model)},
            {local: sampling}, players.generate, purpose="eval", max_context={local: 8192})
            for seed in range(episodes)))
    finally:
        players.close()
    turns = [t for r in results for t in r.transcript if "tokens" in t]
    calls = [c for t in turns for c in t.get("tool_calls", [])]
    measures = env_cls.summary_measures or ()
    return {"model": model, "env": env_name, "episodes": episodes, "seconds": round(time.monotonic() - started, 1),
            "reward": {r: mean(x.rewards[r] for x in results) for r in env_cls.roles if r not in scripted},
            "summary": {m: mean(float(x.summary.get(m, 0)) for x in results) for m in measures},
            "turns_with_a_call": mean(bool(t.get("tool_calls")) for t in turns) if turns else 0.0,
            "calls": len(calls), "failed_calls": sum(c["error"] for c in calls),
            "example_turn": next((t for t in turns if t.get("tool_calls")), turns[0] if turns else None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--env", default="tool_math")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--scripted", action="append", default=[], help="role=player")
    ap.add_argument("--params", default="{}", help="environment.params as JSON")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    scripted = dict(s.split("=", 1) for s in args.scripted)
    out = asyncio.run(measure(args.model, args.env, args.episodes, scripted, json.loads(args.params),
                              args.max_new_tokens, args.temperature))
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
