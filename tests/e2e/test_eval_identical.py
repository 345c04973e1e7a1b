"""The in-run evaluation and ``tandem eval`` give identical numbers for the same checkpoint and seed.

A short ``tandem up`` run (every service a real process, the warm-started demo model) evaluates both
agents against ``random`` and ``minimax`` at the start (on the engines), after step 1 (the step-1
checkpoints, in-process in the coordinator) and at the end (on the engines). ``tandem eval`` then
scores each of those checkpoints on its own; every figure of every report must be the same. B trains LoRA
adapters, so its checkpoints are adapter directories, scored on their base with the adapter merged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from services.common.adapter_dir import is_adapter_dir
from services.common.embedded_redis import free_port
from services.play.offline_eval import main as tandem_eval
from tests.helpers import launch_up

pytestmark = pytest.mark.slow
EPISODES = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, warm_model_dir: Path) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("evalsame")
    agent = {"model_path": str(warm_model_dir), "groups_per_batch": 2, "max_staleness": 0,
             "sampling": {"max_new_tokens": 4}}
    cfg = {"run": {"name": "evalsame", "total_steps": 2, "concurrent_episodes": 16, "seed": 3,
                   "checkpoint_root": str(d / "ckpt"), "output_dir": str(d / "runs")},
           "api": {"port": free_port()},
           "environment": {"name": "tictactoe", "group_size": 4, "roles": {"X": "A", "O": "B"},
                           "alternate_roles": True,
                           "eval": {"episodes": EPISODES, "opponents": ["random", "minimax"], "every_n_steps": 1}},
           "agents": {"A": agent, "B": agent | {"max_staleness": 1, "lora": {"r": 4, "alpha": 8}}}}
    path = d / "evalsame.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with open(d / "launcher.log", "wb") as log:
        proc = launch_up(path, stdout=log)
        try:
            assert proc.wait(timeout=420) == 0, (d / "launcher.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    return path, json.loads((d / "runs" / "evalsame" / "summary.json").read_text())


def test_in_run_evaluations_match_tandem_eval(run: tuple[Path, dict], tmp_path: Path) -> None:
    path, summary = run
    evals = {e["label"]: e for e in summary["evals"]}
    assert list(evals) == ["start", "step-1", "end"]
    for label, entry in evals.items():
        out = tmp_path / f"{label}.json"
        argv = [str(path), "--out", str(out)] + [f"--checkpoint={a}={p}" for a, p in entry["checkpoints"].items()]
        assert tandem_eval(argv) == 0
        offline = json.loads(out.read_text())["agents"]
        for agent in ("A", "B"):
            assert entry["vs"][agent] == offline[agent]["vs"], f"{label} {agent}"
            for opponent in ("random", "minimax"):
                r = entry["vs"][agent][opponent]
                assert r["episodes"] == EPISODES and r["wins"] + r["draws"] + r["losses"] == EPISODES
                assert r["score_se"] is not None and 0 <= r["illegal_rate"] <= 1
                assert r["score_ci95"][0] <= r["score"] <= r["score_ci95"][1]  # the Wilson interval, both sides
    assert evals["step-1"]["versions"] == {"A": 1, "B": 1} and evals["end"]["versions"] == {"A": 2, "B": 2}
    assert is_adapter_dir(evals["end"]["checkpoints"]["B"]) and not is_adapter_dir(evals["end"]["checkpoints"]["A"])


def test_summary_has_eval_curves_and_training_illegal_rate(run: tuple[Path, dict]) -> None:
    _, summary = run
    for agent in ("A", "B"):
        a = summary["agents"][agent]
        for opponent in ("random", "minimax"):
            curve = a["eval_curves"][opponent]
            assert [p["step"] for p in curve] == [0, 1, 2]
            assert all(p["score_se"] is not None and p["illegal_rate"] is not None for p in curve)
            assert all(p["score_ci95"][0] <= p["score"] <= p["score_ci95"][1] for p in curve)
        assert 0 <= a["train_illegal_rate"] <= 1
        assert [p["weight_version"] for p in a["train_play"]][:1] == [0]
        # 2 steps x 2 groups x 4 episodes; a game ends at once on an illegal reply, so an episode whose first
        # mover (the other agent) replied illegally before this agent's first turn is not this agent's play
        ended_first = sum(p["invalid_episodes"] for p in summary["agents"][{"A": "B", "B": "A"}[agent]]["train_play"])
        assert sum(p["episodes"] for p in a["train_play"]) + ended_first >= 2 * 2 * 4
