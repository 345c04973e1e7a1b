"""A frozen agent (``train: false``) is evaluated too (issue 15; docs/architecture.md §8), marked frozen, so a
frozen-partner set-up has a row for it; its score stays out of the training agents' headline figures.

The real coordinator on the real Redis evaluates through its own turn and reply streams; each agent's "engine"
is the tiny model's in-process engine answering that agent's turn stream (as a rollout would).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from services.common.bus import Bus
from services.contracts.config import parse_config
from services.contracts.messages import GenerateRequest
from services.contracts.players import Local
from services.coordinator.report import write_report
from services.coordinator.scheduler import Coordinator
from services.launcher.sweep_report import eval_points
from services.play.local import LocalPlayers


async def test_the_frozen_agent_is_evaluated_and_marked(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = parse_config({"run": {"name": "frozen", "output_dir": str(tmp_path / "runs")}, "redis_url": redis_url,
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"},
                                        "eval": {"episodes": 4, "opponents": ["random", "minimax"]}},
                        "agents": {"A": {"model_path": str(tiny_model_dir), "sampling": {"max_new_tokens": 4}},
                                   "B": {"model_path": str(tiny_model_dir), "sampling": {"max_new_tokens": 4},
                                         "train": False}}})
    bus = Bus(redis_url, "frozen", "coordinator")
    coord = Coordinator(cfg, bus)
    assert list(coord.state.agents) == ["A"]
    local, stop = LocalPlayers(), asyncio.Event()
    served: dict[str, int] = {"A": 0, "B": 0}

    def engine(agent: str):
        async def answer(req: GenerateRequest) -> None:
            served[agent] += 1
            await bus.publish(req.reply_stream, (await local.generate(Local(path=str(tiny_model_dir), agent=agent),
                                                                      req)).model_copy(update={"weight_version": 0}))
        return answer

    tasks = [asyncio.create_task(bus.consume(bus.streams.replies(coord.name), "coordinator", coord.name,
                                             coord.router.on_reply, stop, count=64))]
    tasks += [asyncio.create_task(bus.consume(bus.streams.turns(a), "rollout", f"rollout-{a}", engine(a), stop,
                                              concurrency=4)) for a in "AB"]
    try:
        headline = await asyncio.wait_for(coord.evaluations.evaluate_all("start"), 120)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        local.close()
    assert set(headline) == {"A"} and served["A"] > 0 and served["B"] > 0  # B played on its own engine
    (entry,) = coord.evals
    assert entry["frozen"] == ["B"] and entry["versions"] == {"A": 0, "B": 0}
    for agent in "AB":
        assert set(entry["vs"][agent]) == {"random", "minimax"}
        assert all(r["episodes"] == 4 for r in entry["vs"][agent].values())
    coord.state.agents["A"].eval_start = headline["A"]
    summary = write_report(coord.state, coord.evals, cfg.run_dir(), 1.0)
    points = eval_points(json.loads(summary.read_text()))
    # every opponent of every agent has a sweep row, the frozen B's too
    assert {(p["agent"], p["opponent"]) for p in points} == {(a, o) for a in "AB" for o in ("random", "minimax")}
    await bus.close()
