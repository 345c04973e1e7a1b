"""The terminal view of ``tandem up`` at 80 columns, the evaluation table, and where the services' logs go."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console

from services.launcher.cli import build_parser
from services.launcher.live_view import LIVE_COLUMNS, LogEcho, eval_table, new_evals, status_table
from services.launcher.processes import ProcessGroup, child_env
from services.launcher.progress import Progress
from services.launcher.up import browser_url


def report(score: float, se: float, illegal: float, wins: int, missed_wins: float, missed_blocks: float) -> dict:
    return {"score": score, "score_se": se, "score_ci95": [score - 2 * se, score + 2 * se], "game": True,
            "episodes": 40, "opponent": "random", "wins": wins, "draws": 4, "losses": 40 - wins - 4,
            "illegal_rate": illegal, "illegal_rate_se": 0.02, "mean_reward": 2 * score - 1,
            "summary_means": {"missed_wins": missed_wins, "missed_blocks": missed_blocks}}


def two_agent_status() -> dict:
    """A tic-tac-toe run of two agents mid-way, shaped as the coordinator's ``/v1/status`` answers it."""
    def agent(step: int, reward: float, illegal: float, malformed: float, zero: float) -> dict:
        return {"step": step, "weight_version": step, "loaded_weight_versions": step + 1, "mean_reward": reward,
                "recent_group_reward": reward, "eval_start": 0.412, "eval_end": None, "illegal_rate": illegal,
                "signal": {"zero_variance_groups": zero, "malformed_rate": malformed, "no_signal_steps": 0},
                "rollout": {"engines": [], "router_restarts": 0}}

    evals = [{"label": "start", "time": 1000.0, "versions": {"A": 0, "B": 0}, "opponents": ["random", "minimax"],
              "vs": {"A": {"random": report(0.412, 0.071, 0.325, 14, 0.62, 0.71),
                           "minimax": report(0.05, 0.031, 0.3, 0, 0.7, 0.8)},
                     "B": {"random": report(0.388, 0.069, 0.35, 13, 0.6, 0.75),
                           "minimax": report(0.0, 0.0, 0.31, 0, 0.66, 0.79)}}},
             {"label": "step-40", "time": 2000.0, "versions": {"A": 40, "B": 40}, "opponents": ["random", "minimax"],
              "vs": {"A": {"random": report(0.833, 0.052, 0.025, 31, 0.12, 0.2),
                           "minimax": report(0.237, 0.061, 0.0, 0, 0.3, 0.41)},
                     "B": {"random": report(0.791, 0.058, 0.05, 29, 0.18, 0.26),
                           "minimax": report(0.2, 0.058, 0.025, 0, 0.33, 0.44)}}}]
    return {"run": "demo", "phase": "training", "total_steps": 100, "episodes_per_s": 12.34, "paused": False,
            "agents": {"A": agent(47, -0.412, 0.031, 0.125, 0.281), "B": agent(45, 0.508, 0.062, 0.0, 0.344)},
            "evals": evals}


def render(renderable: object, width: int = 80) -> str:
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_live_view_fits_80_columns_uncut() -> None:
    status, progress, now = two_agent_status(), Progress(), time.time()
    for t, (a, b) in ((-90.0, (44, 42)), (-60.0, (45, 43)), (-30.0, (46, 44)), (0.0, (47, 45))):
        status["agents"]["A"]["step"], status["agents"]["B"]["step"] = a, b
        progress.update(status, now=now + t)
    text = render(status_table(status, {"trainer.B": 1}, progress))
    print(text)
    lines = text.splitlines()
    assert "…" not in text and max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "agent" in line)
    assert all(col in header for col in LIVE_COLUMNS)  # each header whole, on the one header line
    assert "Tandem run demo — training — 12.34 episodes/s" in text
    row_a = next(line for line in lines if "│ A " in line)
    for value in ("47/100", "-0.412", "0.03", "0.12", "0.28", "vs random 0.83"):
        assert value in row_a, (value, row_a)
    row_b = next(line for line in lines if "│ B " in line)
    for value in ("45/100", "0.508", "0.06", "0.00", "0.34", "vs random 0.79"):
        assert value in row_b, (value, row_b)
    assert "A: 2.00 steps/min, ETA " in text and "weights v47" in text and "start vs random 0.41" in text
    assert "restarts: trainer.B 1" in text
    status["agents"]["A"]["signal"]["no_signal_steps"] = 3
    assert "A: no learning signal in 3 steps in a row" in render(status_table(status))
    assert "…" not in render(status_table(None))


def test_each_evaluation_prints_once_as_a_small_table() -> None:
    status, shown = two_agent_status(), set()
    fresh = new_evals(status, shown)
    assert [ev["label"] for ev in fresh] == ["start", "step-40"] and new_evals(status, shown) == []
    text = render(eval_table(fresh[1]))
    print(text)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for word in ("eval step-40", "agent", "opponent", "score ± SE", "missed_wins", "missed_blocks", "illegal",
                 "A v40", "minimax", "0.833 ± 0.052", "0.237 ± 0.061", "0.12", "0.41", "0.03"):
        assert word in text, word
    language = {"label": "end", "vs": {"A": {"wrong": {"score": 0.5, "game": False, "mean_reward": 0.25,
                                                       "illegal_rate": 0.1, "summary_means": {"found": 0.8}}}}}
    text = render(eval_table(language))
    assert "score" not in text and "reward" in text and "found" in text and "0.80" in text
    status["evals"] = [language]
    status["agents"] = {"A": status["agents"]["A"]}
    text = render(status_table(status))  # a long cell wraps inside its column, never cut
    assert "vs wrong found" in text and "0.80" in text and "…" not in text


def test_verbose_is_accepted_and_logs_land_in_the_run_directory(tmp_path: Path) -> None:
    assert build_parser().parse_args(["up", "c.yaml", "--verbose"]).verbose
    assert browser_url("0.0.0.0", 8900) == "http://127.0.0.1:8900" == browser_url("127.0.0.1", 8900)  # first line
    assert not build_parser().parse_args(["up", "c.yaml"]).verbose
    code = ("import sys; print('06:30:01 INFO tandem.rollout: engine up'); "
            "print('06:30:02 WARNING tandem.rollout: slow reply'); "
            "print('Traceback (most recent call last):'); print('  File \"x.py\", line 1'); "
            "print('ValueError: broken'); print('06:30:03 INFO tandem.rollout: goes on'); "
            "[print('WARN worker http://127.0.0.1:5 will be accessible without authentication') for _ in 'ab']; "
            "[print('WARNING:  Invalid HTTP request received.') for _ in 'abc']")
    for verbose in (False, True):
        logs = tmp_path / f"runs-{verbose}" / "demo" / "logs"
        console = Console(width=120, record=True, force_terminal=False, color_system=None)
        group = ProcessGroup(logs, child_env({}), LogEcho(console, verbose))
        child = group.start("rollout.A", [sys.executable, "-c", code])
        child.proc.wait(30)
        child.pump.join(10)
        logged = (logs / "rollout.A.log").read_text()
        assert "engine up" in logged and "slow reply" in logged and "ValueError: broken" in logged
        shown = console.export_text()
        assert "rollout.A │ 06:30:02 WARNING tandem.rollout: slow reply" in shown
        assert "ValueError: broken" in shown and '  File "x.py", line 1' in shown
        assert ("engine up" in shown) is verbose and ("goes on" in shown) is verbose
        assert shown.count("(harmless: the SGLang router warns") == 1  # a known warning: explained once
        assert shown.count("accessible without authentication") == (2 if verbose else 1)
        assert shown.count("(harmless: an engine's web server (uvicorn) logs the SGLang router's gRPC probe") == 1
        assert shown.count("Invalid HTTP request received") == (3 if verbose else 1)
