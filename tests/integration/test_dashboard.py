"""The dashboard's server side, the tic-tac-toe board drawing, the RunLogger (TensorBoard + W&B offline),
``tandem runs`` / ``tandem compare`` and a finished run's read-only dashboard on reports written by the
coordinator's own report code, and the terminal view's steps per minute and ETA.

Episodes are played for real (a tiny model in-process against the env's scripted player) through the
coordinator's own ``_play``, which records them in a real Redis; the routes are called over ASGI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.common.bus import Bus
from services.contracts.config import ConfigError, parse_config
from services.contracts.players import Local, Scripted
from services.coordinator.api import create_app
from services.coordinator.dashboard.transcripts import matches
from services.coordinator.report import write_report
from services.coordinator.scheduler import Coordinator
from services.coordinator.state import RunState
from services.coordinator.tracking import RunLogger
from services.envs.base import Environment
from services.envs.tictactoe import TicTacToe
from services.launcher.progress import Progress, fmt_duration
from services.launcher.runs import group_steps
from services.launcher.up import status_table

REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, model: str = "m", **extra) -> dict:
    return {"run": {"name": "dash", "output_dir": str(tmp_path / "runs"), "checkpoint_root": str(tmp_path / "ck")},
            "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
            "agents": {"A": {"model_path": model, "sampling": {"max_new_tokens": 4}},
                       "B": {"model_path": model, "sampling": {"max_new_tokens": 4}}}, **extra}


def test_tictactoe_draws_its_board() -> None:
    html = TicTacToe.render({"board": "xo..x...x", "moves": [1, 2, 5, 9], "winner": "X", "illegal": False})
    assert html is not None and html.count("<td") == 9 and "X wins" in html
    assert html.count('class="ttt-x') == 3 and html.count('class="ttt-o') == 1
    assert 'class="ttt-x last">X<sub>4</sub>' in html  # the last move, numbered
    assert "&lt;" in TicTacToe.render({"board": "x........", "moves": [1], "illegal": True, "illegal_reply": "<b>"})
    assert TicTacToe.render({"board": "nonsense"}) is None
    assert TicTacToe.render_format == "html" and Environment.render({}) is None


def test_transcript_filters() -> None:
    rec = {"purpose": "train", "roles": {"X": "A", "O": "B"}, "rewards": {"X": 1.0, "O": -1.0}}
    assert matches(rec) and matches(rec, agent="A", role="X", purpose="train")
    assert not matches(rec, agent="A", role="O") and not matches(rec, agent="C") and not matches(rec, purpose="eval")
    assert matches(rec, agent="A", min_reward=0.5) and not matches(rec, agent="B", min_reward=0.5)
    assert matches(rec, role="O", max_reward=-1.0) and not matches(rec, role="X", max_reward=0.0)


def test_logging_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="logging.wandb.mode"):
        parse_config(_cfg(Path("/tmp"), logging={"wandb": {"project": "p", "mode": "cloudy"}}))
    with pytest.raises(ConfigError, match="logging.interval_s"):
        parse_config(_cfg(Path("/tmp"), logging={"interval_s": 0}))
    assert parse_config(_cfg(Path("/tmp"))).logging.wandb is None


async def test_dashboard_routes_over_real_episodes(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = parse_config(_cfg(tmp_path, str(tiny_model_dir), redis_url=redis_url, api={"token": "tok"}))
    coord = Coordinator(cfg, Bus(redis_url, "dash", "coordinator"))
    player = Local(path=str(tiny_model_dir), agent="A")
    roles = {"X": player, "O": Scripted(name="random")}
    for i in range(3):
        await coord.episode_log.play(TicTacToe({}, i), f"g{i}", roles, "train" if i else "eval",
                                     coord.players.sampling_for(roles))
    assert coord.state.episodes_done == 3
    transport = httpx.ASGITransport(app=create_app(coord))
    async with httpx.AsyncClient(transport=transport, base_url="http://dash") as anon, \
            httpx.AsyncClient(transport=transport, base_url="http://dash",
                              headers={"Authorization": "Bearer tok"}) as client:
        page = await anon.get("/")  # the page, its assets and info are open: the page asks for the token
        assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
        assert (await anon.get("/dashboard/static/vendor/uPlot.iife.min.js")).status_code == 200
        info = (await anon.get("/v1/dashboard/info")).json()
        assert info["token_required"] is True and info["env_roles"] == ["X", "O"]
        for path in ("/health", "/metrics"):
            assert (await anon.get(path)).status_code == 200, path
        reads = ("/v1/status", "/v1/episodes", "/v1/episodes/nope", "/v1/metrics", "/v1/dashboard/pipeline",
                 "/v1/dashboard/episodes", "/v1/dashboard/episodes/nope", "/v1/dashboard/episodes/nope/tokens")
        for headers in ({}, {"Authorization": "Bearer tok2"}, {"Authorization": "tok"}):
            for path in reads:  # the token guards reads too
                resp = await anon.get(path, headers=headers)
                assert resp.status_code == 401 and "Bearer <api.token>" in resp.json()["detail"], path
        listed = (await client.get("/v1/dashboard/episodes", params={"purpose": "train"})).json()
        assert listed["total"] == 2 and all(e["purpose"] == "train" for e in listed["episodes"])
        mine = {"agent": str(player), "role": "O"}
        assert (await client.get("/v1/dashboard/episodes", params=mine)).json()["total"] == 0
        bad = await client.get("/v1/dashboard/episodes", params={"role": "Z"})
        assert bad.status_code == 422 and "role 'Z'" in bad.json()["detail"]
        assert (await client.get("/v1/dashboard/episodes", params={"min_reward": "x"})).status_code == 422
        ep_id = listed["episodes"][0]["id"]
        ep = (await client.get(f"/v1/dashboard/episodes/{ep_id}")).json()
        assert ep["board"]["format"] == "html" and "ttt-board" in ep["board"]["content"]
        toks = (await client.get(f"/v1/dashboard/episodes/{ep_id}/tokens")).json()
        model_turns = [t for t in ep["turns"] if t["role"] == "X" and "tokens" in t]
        assert [t["turn"] for t in toks["X"]["turns"]] == [t["turn"] for t in model_turns]
        for mine, turn in zip(toks["X"]["turns"], model_turns, strict=True):
            assert len(mine["ids"]) == len(mine["logprobs"]) == len(mine["texts"]) == turn["tokens"]
            assert all(lp <= 0 for lp in mine["logprobs"]) and mine["weight_version"] == turn["weight_version"]
        assert (await client.get("/v1/dashboard/episodes/nope")).status_code == 404
        assert (await client.get(f"/v1/episodes/{ep_id}")).json() | {"board": ep["board"]} == ep  # one record
        assert (await client.get("/v1/episodes/nope")).status_code == 404
        pipe = (await client.get("/v1/dashboard/pipeline")).json()
        assert pipe["gates"]["A"]["limit"] == 4 and pipe["gates"]["A"]["blocked"] is False
        refused = await anon.post("/v1/pause")
        assert refused.status_code == 401
    await coord.bus.close()


def _state(cfg, steps: int, rewards: list[float]) -> RunState:
    state = RunState.from_config(cfg)
    t0 = time.time()
    for name, a in state.agents.items():
        for v in range(1, steps + 1):
            a.train_steps.append({"weight_version": v, "pg_loss": 0.1 * v, "kl": 0.01, "clip_frac": 0.0,
                                  "grad_norm": 1.0, "tokens_per_s": 100.0, "algorithm": "grpo", "time": t0 + v})
            a.loaded_weight_version = v
            a.loaded_weight_versions.append(v)
        a.group_rewards = [(t0 + i, r) for i, r in enumerate(rewards)]
        a.eval_start, a.eval_end = 0.25, 0.5 if name == "A" else 0.4
    state.phase = "done"
    return state


def _evals(state: RunState) -> list[dict]:
    return [{"label": label, "time": time.time(), "scores": {n: s for n in state.agents},
             "details": {n: {"wins": 1, "draws": 0, "losses": 1, "mean_reward": 0.0} for n in state.agents},
             "versions": {n: v for n in state.agents}} for label, s, v in (("start", 0.25, 0), ("end", 0.5, 3))]


async def test_run_logger_writes_tensorboard_and_wandb_offline(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = parse_config(_cfg(tmp_path, logging={"wandb": {"project": "tandem-test", "mode": "offline"},
                                               "text_every": 1}))
    state = _state(cfg, 3, [0.1, -0.2, 0.5, 0.7])
    coord = type("Followed", (), {"state": state, "evals": _evals(state), "episodes": {
        "e1": {"id": "e1", "group_id": "g", "purpose": "train", "roles": {"X": "A", "O": "B"},
               "rewards": {"X": 1.0, "O": -1.0}, "turns": [{"turn": 0, "role": "X", "agent": "A", "text": "5|"}]}}})()
    state.episodes_done = 1
    logger = RunLogger(cfg)
    await logger.close(coord)
    await logger.close(coord)  # idempotent
    acc = EventAccumulator(str(cfg.run_dir() / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for agent in ("A", "B"):
        for key in ("pg_loss", "kl", "clip_frac", "grad_norm", "tokens_per_s"):
            assert [e.step for e in acc.Scalars(f"{agent}/train/{key}")] == [1, 2, 3]
        group_means = acc.Scalars(f"{agent}/reward/group_mean")  # each group at the version trained then
        assert [e.step for e in group_means] == [0, 1, 2, 3]
        assert [e.value for e in group_means] == pytest.approx([0.1, -0.2, 0.5, 0.7])
        assert f"{agent}/pipeline/groups_kept" in tags  # the eval's tags: tests/unit/test_tensorboard_steps.py
    assert acc.Tags()["tensors"] == ["transcripts/train/text_summary"]
    runs = list((cfg.run_dir() / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))[0].stat().st_size > 0


def test_compare_places_each_group_on_the_training_step_axis() -> None:
    groups = [(t, 0.0) for t in (1, 2, 3, 5, 6, 9)]
    steps = [{"weight_version": 2, "time": 8}, {"weight_version": 1, "time": 4}]
    assert group_steps(groups, steps) == pytest.approx([0, 1 / 3, 2 / 3, 1, 1.5, 2])  # as the dashboard's chart
    assert group_steps(groups, []) == pytest.approx([i / 6 for i in range(6)])


def test_runs_and_compare_over_two_reports(tmp_path: Path) -> None:
    for name, rewards in (("first", [-0.5, 0.0, 0.2]), ("second", [0.1, 0.4, 0.6, 0.9])):
        cfg = parse_config(_cfg(tmp_path) | {"run": {"name": name, "output_dir": str(tmp_path / "runs")}})
        state = _state(cfg, 3, rewards)
        write_report(state, _evals(state), cfg.run_dir(), 12.5)
    (tmp_path / "runs" / "broken" / "logs").mkdir(parents=True)
    cli = [sys.executable, "-m", "services.launcher.cli"]
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    listed = subprocess.run([*cli, "runs", "--dir", str(tmp_path / "runs")], cwd=REPO, capture_output=True,
                            text=True, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "first" in listed.stdout and "second" in listed.stdout and "running" in listed.stdout
    done = subprocess.run([*cli, "compare", "first", "second", "--dir", str(tmp_path / "runs")], cwd=REPO,
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "runs" / "compare"
    assert (out / "compare.png").stat().st_size > 10_000
    table = (out / "compare.md").read_text()
    assert "| first | A | done | 3 | -0.500 | 0.200 | 0.250 | 0.500 |" in table
    assert table.count("| second |") == 2
    missing = subprocess.run([*cli, "compare", "first", "nope", "--dir", str(tmp_path / "runs")], cwd=REPO,
                             capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(_cfg(tmp_path)))  # its run.output_dir is tmp_path/runs
    by_config = subprocess.run([*cli, "runs", "--config", str(cfg_path)], cwd=REPO, capture_output=True, text=True,
                               env=env)
    assert by_config.returncode == 0 and "second" in by_config.stdout


async def test_a_finished_runs_dashboard_from_its_report(tmp_path: Path) -> None:
    """``tandem dashboard``'s app over a report the coordinator's own code wrote: read-only, no secret kept."""
    from services.coordinator.dashboard import STATIC
    from services.coordinator.dashboard.finished import FinishedRun, build_app

    cfg = parse_config(_cfg(tmp_path, api={"token": "s3cret"}))
    state = _state(cfg, 3, [0.1, 0.4, 0.6])
    evals = _evals(state)
    write_report(state, evals, cfg.run_dir(), 12.5)
    assert "s3cret" not in (cfg.run_dir() / "config.json").read_text()
    run = FinishedRun.load(cfg.run_dir())
    transport = httpx.ASGITransport(app=build_app(run, STATIC))
    async with httpx.AsyncClient(transport=transport, base_url="http://a") as client:
        info = (await client.get("/v1/dashboard/info")).json()
        assert info["read_only"] and not info["token_required"] and info["environment"] == "tictactoe"
        status = (await client.get("/v1/status")).json()
        assert status["agents"]["A"]["step"] == 3 and status["evals"] == evals
        assert (await client.get("/v1/metrics")).json()["A"]["group_rewards"] == [list(g) for g in
                                                                                  state.agents["A"].group_rewards]
        assert (await client.post("/v1/stop")).status_code == 405
        listed = (await client.get("/v1/dashboard/episodes", params={"source": "archive"})).json()
        assert listed == {"total": 0, "source": "archive", "episodes": []}
        assert (await client.get("/v1/dashboard/episodes/nope")).status_code == 404
    (cfg.run_dir() / "config.json").unlink()
    with pytest.raises(ValueError, match="--run-config"):
        FinishedRun.load(cfg.run_dir())


def test_steps_per_minute_and_eta() -> None:
    p = Progress()
    status = {"run": "r", "phase": "training", "total_steps": 10, "episodes_per_s": 1.0, "agents": {
        "A": {"step": 0, "weight_version": 0, "recent_group_reward": None, "eval_start": None, "eval_end": None}}}
    assert p.steps_per_min("A") is None and p.run_eta_s(status) is None
    for t, step in ((0.0, 0), (30.0, 1), (60.0, 2), (90.0, 4)):
        status["agents"]["A"]["step"] = step
        p.update(status, now=1000.0 + t)
    assert p.steps_per_min("A") == pytest.approx(4 * 60 / 90)
    assert p.eta_s("A", 4, 10, now=1090.0) == pytest.approx(6 * 90 / 4)
    assert fmt_duration(135) == "2m15s" and fmt_duration(3700) == "1h01m"
    table = status_table(status, progress=p)
    assert "A: 2.67 steps/min, ETA " in str(table.caption)  # each agent's pace and ETA, under the table
    assert json.dumps(status)  # the status stays plain JSON
