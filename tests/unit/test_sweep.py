"""``tandem sweep`` (services/launcher/sweep.py, sweep_report.py): keys, set-ups, the table's math, end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.contracts.config import ConfigError
from services.launcher.sweep import (
    SubRun,
    is_done,
    parse_assignment,
    parse_seeds,
    parse_setup,
    plan,
)
from services.launcher.sweep_report import aggregate, eval_points, markdown, mean_se, write_report

REPO = Path(__file__).resolve().parents[2]


def _base(tmp_path: Path, model: str = "models/demo-ttt", **run: object) -> Path:
    cfg = {"run": {"name": "base", "total_steps": 2, "output_dir": str(tmp_path / "runs"),
                   "checkpoint_root": str(tmp_path / "ckpt"), **run},
           "environment": {"name": "tictactoe", "group_size": 2, "roles": {"X": "A", "O": "B"},
                           "alternate_roles": True, "eval": {"episodes": 4}},
           "agents": {a: {"model_path": model, "groups_per_batch": 1, "seed": i + 1}
                      for i, a in enumerate(("A", "B"))}}
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_values_are_yaml_scalars() -> None:
    assert parse_assignment("agents.A.algorithm.lr=1e-3") == ("agents.A.algorithm.lr", 0.001)
    assert parse_assignment("agents.B.train=false") == ("agents.B.train", False)
    assert parse_assignment("run.total_steps=6") == ("run.total_steps", 6)
    assert parse_assignment("environment.eval.opponent=minimax") == ("environment.eval.opponent", "minimax")
    assert parse_assignment("environment.roles={X: A, O: 'pool:A'}")[1] == {"X": "A", "O": "pool:A"}
    for bad in ("run.total_steps", "=3", "a..b=1"):
        with pytest.raises(ConfigError, match="KEY=VALUE"):
            parse_assignment(bad)


def test_setups_split_on_commas_only_before_a_key() -> None:
    s = parse_setup("pool:environment.roles={X: A, O: 'pool:A'},agents.B.train=false,config=c.yaml")
    assert s.name == "pool" and s.config == "c.yaml"
    assert s.sets == [("environment.roles", {"X": "A", "O": "pool:A"}), ("agents.B.train", False)]
    assert parse_setup("plain").sets == []
    with pytest.raises(ConfigError, match="name"):
        parse_setup("bad name:run.seed=1")


def test_seeds() -> None:
    assert parse_seeds("0,1, 2") == [0, 1, 2]
    for bad in ("", "0,0", "a", "-1"):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad)


def test_a_bad_key_or_value_fails_at_start_naming_the_key(tmp_path: Path) -> None:
    base = str(_base(tmp_path))
    for key, value, why in (("agents.A.algorithm.lrr", 0.1, "Extra inputs"), ("run.total_steps", "many", "int"),
                            ("environment.eval.nope", 1, "Extra inputs"), ("agents.A.sampling.temperature", -1, "")):
        with pytest.raises(ConfigError, match=rf"--set {key}=.*{why}"):
            plan(base, [0], [(key, value)], [], "sw")
    with pytest.raises(ConfigError, match="--set run.total_steps.x: run.total_steps is a value"):
        plan(base, [0], [("run.total_steps.x", 1)], [], "sw")
    with pytest.raises(ConfigError, match="--set agents.A.trainn="):
        plan(base, [0], [], [parse_setup("f:agents.A.trainn=false")], "sw")
    assert not (tmp_path / "runs").exists()  # nothing written before every key is checked


def test_the_plan_names_and_places_every_sub_run_inside_the_sweep(tmp_path: Path) -> None:
    base = _base(tmp_path)
    other = tmp_path / "other.yaml"
    data = yaml.safe_load(base.read_text())
    data["environment"]["roles"] = {"X": "A", "O": "A"}
    del data["agents"]["B"]
    other.write_text(yaml.safe_dump(data))
    subs = plan(str(base), [0, 2], [("run.total_steps", 3)],
                [parse_setup("co"), parse_setup("frozen:agents.B.train=false"), parse_setup(f"self:config={other}")],
                "sw")
    assert [s.name for s in subs] == ["sw.co.s0", "sw.co.s2", "sw.frozen.s0", "sw.frozen.s2", "sw.self.s0",
                                      "sw.self.s2"]
    s = subs[3]
    assert s.run_dir == tmp_path / "runs" / "sw" / "sw.frozen.s2"
    assert s.cfg.run.checkpoint_root == str(tmp_path / "ckpt" / "sw") and s.cfg.run.seed == 2
    assert (s.cfg.agents["A"].seed, s.cfg.agents["B"].seed) == (2001, 2002) and not s.cfg.agents["B"].train
    assert s.cfg.run.total_steps == 3 and s.cfg.api.port == 0
    assert subs[0].cfg.agents["A"].seed == 1 and subs[0].cfg.agents["B"].train
    assert list(subs[4].cfg.agents) == ["A"]
    assert s.config_path == tmp_path / "runs" / "sw" / "configs" / "sw.frozen.s2.yaml"


def _summary(a_start: float, a_end: float, illegal: float | None = None) -> dict:
    rep = lambda s: {"score": s, "opponent": "random", "episodes": 4, **({"illegal_rate": illegal}  # noqa: E731
                                                                         if illegal is not None else {})}
    return {"phase": "done", "error": None, "agents": {"A": {"steps": 2}},
            "evals": [{"label": "start", "scores": {"A": a_start}, "details": {"A": rep(a_start)},
                       "versions": {"A": 0}},
                      {"label": "end", "scores": {"A": a_end}, "details": {"A": rep(a_end)}, "versions": {"A": 2}}]}


def test_the_table_is_mean_and_standard_error_across_seeds(tmp_path: Path) -> None:
    subs = plan(str(_base(tmp_path)), [0, 1, 2], [], [parse_setup("co"), parse_setup("fr:agents.B.train=false")],
                "sw")
    ends = {0: 0.5, 1: 0.7, 2: 0.6}
    for s in subs:
        s.run_dir.mkdir(parents=True)
        if not (s.setup == "fr" and s.seed == 2):  # one sub-run never finished
            (s.run_dir / "summary.json").write_text(json.dumps(_summary(0.4, ends[s.seed], illegal=0.1 * s.seed)))
    agg = aggregate(subs)
    row = agg["co"]["rows"][0]
    assert (row["agent"], row["opponent"], row["seeds"], row["end_step"]) == ("A", "random", [0, 1, 2], 2)
    assert math.isclose(row["end"]["mean"], 0.6) and math.isclose(row["end"]["se"], 0.1 / math.sqrt(3))
    assert math.isclose(row["gain"]["mean"], 0.2) and math.isclose(row["start"]["se"], 0.0, abs_tol=1e-12)
    assert math.isclose(row["illegal"]["mean"], 0.1) and row["train_illegal"]["n"] == 0
    assert agg["fr"]["missing"] == ["sw.fr.s2"] and agg["fr"]["rows"][0]["seeds"] == [0, 1]
    table = markdown(agg, "t")
    assert "| co | A | random | 3 | 2 | 0.400 ± 0.000 | 0.600 ± 0.058 | 0.200 ± 0.058 | 0.100 ± 0.058 | - |" in table
    assert "missing: sw.fr.s2" in table
    md, js, png = write_report(subs, tmp_path / "runs" / "sw", "sw")
    assert png.stat().st_size > 5000 and json.loads(js.read_text())["setups"]["co"]["rows"][0]["end"]["n"] == 3


def test_the_table_carries_the_environments_episode_measures(tmp_path: Path) -> None:
    """A shaped reward's score is not the task's: the sweep also means each eval's ``summary_means``."""
    subs = plan(str(_base(tmp_path)), [0, 1], [], [parse_setup("co")], "sw")
    for s, turns in zip(subs, (8.0, 9.0), strict=True):
        summary = _summary(0.3, 0.5)
        for ev, means in zip(summary["evals"], ({"turns": 10.0, "found": 0.9}, {"turns": turns, "found": 1.0}),
                             strict=True):
            ev["details"]["A"]["summary_means"] = means
        s.run_dir.mkdir(parents=True)
        (s.run_dir / "summary.json").write_text(json.dumps(summary))
    row = aggregate(subs)["co"]["rows"][0]
    turns = row["summary_means"]["turns"]
    assert turns["start"]["mean"] == 10.0 and turns["end"]["mean"] == 8.5 and math.isclose(turns["end"]["se"], 0.5)
    assert row["summary_means"]["found"]["end"] == {"mean": 1.0, "se": 0.0} and turns["n"] == 2
    assert "| co | A | random | turns | 10.000 ± 0.000 | 8.500 ± 0.500 |" in markdown(aggregate(subs), "t")


def test_each_seeds_gain_is_given_in_its_own_standard_errors(tmp_path: Path) -> None:
    subs = plan(str(_base(tmp_path)), [0, 1], [], [parse_setup("co")], "sw")
    for s, (end, end_se) in zip(subs, ((0.8, 0.04), (0.5, None)), strict=True):
        summary = _summary(0.5, end)
        summary["evals"][0]["details"]["A"]["score_se"] = 0.03
        if end_se is not None:
            summary["evals"][1]["details"]["A"]["score_se"] = end_se
        s.run_dir.mkdir(parents=True)
        (s.run_dir / "summary.json").write_text(json.dumps(summary))
    seeds = aggregate(subs)["co"]["rows"][0]["per_seed"]
    assert math.isclose(seeds[0]["gain_in_se"], 0.3 / 0.05) and seeds[1]["gain_in_se"] is None
    table = markdown(aggregate(subs), "t")
    assert "| co | A | random | 0 | 0.500 ± 0.030 | 0.800 ± 0.040 | 6.0 |" in table
    assert "| co | A | random | 1 | 0.500 ± 0.030 | 0.500 | - |" in table


def test_mean_se_and_eval_shapes() -> None:
    assert mean_se([]) == (None, None, 0) and mean_se([0.5]) == (0.5, None, 1)
    assert mean_se([1.0, float("nan"), None, 3.0])[:2] == (2.0, 1.0)  # type: ignore[list-item]
    per_opponent = {"evals": [{"label": "start", "versions": {"A": 0}, "scores": {"A": {"random": 0.5, "minimax": 0.1}},
                               "details": {"A": {"random": {"score": 0.5, "illegal_rate": 0.02},
                                                 "minimax": {"score": 0.1}}}}]}
    points = eval_points(per_opponent)
    assert [(p["opponent"], p["score"], p["illegal"]) for p in points] == [("random", 0.5, 0.02),
                                                                           ("minimax", 0.1, None)]
    assert eval_points({"evals": [{"scores": {"A": 0.3}, "versions": {"A": 4}}]}, "random")[0]["step"] == 4
    # the coordinator's shape: "details" holds the headline opponent's report, "vs" every opponent's
    both = {"evals": [{"label": "end", "versions": {"A": 3}, "scores": {"A": 0.6},
                       "details": {"A": {"score": 0.6, "opponent": "random"}},
                       "vs": {"A": {"random": {"score": 0.6}, "minimax": {"score": 0.2, "illegal_rate": 0.01}}}}]}
    assert [(p["opponent"], p["score"], p["illegal"], p["step"]) for p in eval_points(both)] == [
        ("random", 0.6, None, 3), ("minimax", 0.2, 0.01, 3)]


def test_a_done_sub_run_with_the_same_config_is_kept(tmp_path: Path) -> None:
    sub: SubRun = plan(str(_base(tmp_path)), [0], [], [], "sw")[0]
    text = yaml.safe_dump(sub.data, sort_keys=False)
    sub.run_dir.mkdir(parents=True)
    sub.config_path.parent.mkdir(parents=True)
    sub.config_path.write_text(text)
    (sub.run_dir / "summary.json").write_text(json.dumps({"phase": "done", "error": None}))
    assert is_done(sub, text) and not is_done(sub, text + "# changed\n")
    (sub.run_dir / "summary.json").write_text(json.dumps({"phase": "stopped", "error": None}))
    assert not is_done(sub, text)


@pytest.mark.integration  # a child process: `tandem sweep`
def test_the_cli_refuses_a_bad_key_with_exit_2(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "services.launcher.cli", "sweep", str(_base(tmp_path)),
                          "--seeds", "0,1", "--set", "agents.A.algorithm.lrr=1e-3"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "agents.A.algorithm.lrr" in res.stderr


@pytest.mark.slow
def test_a_two_seed_sweep_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two real ``tandem up`` runs of the tiny model, one set-up with B frozen: a table row per agent, both seeds.
    (Several set-ups side by side are the same sub-runs more often: the table's math for them is tested above.)"""
    base = _base(tmp_path, str(tiny_model_dir), total_steps=1, concurrent_episodes=4)
    outside = tmp_path / "runs" / "keep"  # a run outside the sweep's names survives its --fresh runs
    outside.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "sweep", str(base), "--seeds", "0,1",
                             "--name", "e2e", "--set", "environment.eval.episodes=2",
                             "--setup", "frozen:agents.B.train=false"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the sweep stops its running `tandem up`, which stops its services
        output, _ = proc.communicate(timeout=180)
        raise AssertionError(f"the sweep ran past 600 s:\n{output[-3000:]}") from None
    assert proc.returncode == 0, output[-3000:]
    out = tmp_path / "runs" / "e2e"
    setups = json.loads((out / "sweep.json").read_text())["setups"]
    assert sorted(setups) == ["frozen"] and all(not s["missing"] for s in setups.values())
    rows = {(name, r["agent"]): r for name, s in setups.items() for r in s["rows"]}
    assert set(rows) == {("frozen", "A"), ("frozen", "B")}  # the frozen agent too
    assert all(r["seeds"] == [0, 1] and r["end"]["n"] == 2 for r in rows.values())
    assert [k for k, r in rows.items() if not r["trains"]] == [("frozen", "B")]  # marked frozen
    assert rows[("frozen", "B")]["end_step"] == 0 and rows[("frozen", "B")]["gain"]["mean"] == 0  # never trained
    assert rows[("frozen", "A")]["end_step"] >= 1 and (out / "sweep.png").stat().st_size > 5000
    assert "| frozen | A |" in (out / "sweep.md").read_text() and outside.is_dir()
    assert (tmp_path / "ckpt" / "e2e" / "e2e.frozen.s1").is_dir()
