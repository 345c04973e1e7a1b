"""The dashboard in a real headless Chromium against a live ``tandem up`` (Debian's chromium + chromedriver,
installed by ``make browser``, which ``make test`` runs).

Checks, in file order on one run (api.token configured): the charts hold points for both agents and
grow while the run goes on, no tick label is cut off or repeated and every title names what it plots;
opening a transcript shows the episode's turns, rewards, each turn's reward and (on demand) its tokens,
and the list holds still while it is open; archived transcripts open, and the whole page is saved at
1400 and 800 px wide (build/dashboard-1400.png, build/dashboard-800.png); a control action without the
token is refused; pause and resume from the page change ``/v1/status``. After the run is stopped from the
API, TensorBoard's own EventAccumulator finds every scalar series on the weight-version axis, W&B
(offline) has written its run directory, ``tandem compare`` over this run and a second short one writes
the PNG and the table, and ``tandem dashboard`` serves that second, finished run read-only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

from services.common.embedded_redis import free_port
from tests.dashboard_page import axis_problems, charts, screenshot, title_problems
from tests.helpers import launch_up, wait_until

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TOKEN = "dash-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    errors = (httpx.HTTPError, KeyError, ValueError, WebDriverException)  # e.g. a chart not drawn yet
    return wait_until(predicate, timeout, what, proc, errors=errors, interval=0.3)


def _config(d: Path, name: str, model: Path, port: int, steps: int, **extra) -> Path:
    cfg = {
        "run": {"name": name, "total_steps": steps, "concurrent_episodes": 8, "checkpoint_root": str(d / "ckpt"),
                "output_dir": str(d / "runs"), **extra.get("run", {})},
        "api": {"port": port, **extra.get("api", {})},
        "logging": {"interval_s": 1.0, "text_every": 3, **extra.get("logging", {})},
        "environment": {"name": "tictactoe", "group_size": 4, "roles": {"X": "A", "O": "B"},
                        "alternate_roles": True, "eval": {"episodes": extra.get("eval_episodes", 4)}},
        "agents": {a: {"model_path": str(model), "groups_per_batch": 2, "max_staleness": 1,
                       "max_no_signal_steps": 0,  # a long run about the page, not learning: no signal stop
                       "sampling": {"max_new_tokens": 4}} for a in ("A", "B")},
    }
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(cfg: Path, log: Path) -> subprocess.Popen:
    return launch_up(cfg, stdout=open(log, "wb"))


@pytest.fixture(scope="module")
def live(tmp_path_factory, warm_model_dir):
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver_bin, "Debian's chromium and chromium-driver are missing: run `make browser`"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    d = tmp_path_factory.mktemp("dash")
    port = free_port()
    proc = _launch(_config(d, "dash", warm_model_dir, port, steps=100_000,  # stopped by the tests, never done
                           api={"token": TOKEN}, run={"transcripts_kept": 4},  # older ones archived
                           logging={"wandb": {"project": "tandem-test", "mode": "offline"}}),
                   d / "launcher.log")
    api = f"http://127.0.0.1:{port}"
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console, read by the chart test
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,2200"):
        opts.add_argument(arg)
    driver = None
    try:
        _wait(lambda: httpx.get(f"{api}/health", timeout=2).status_code == 200, 300, "the control API", proc)
        started = time.time()
        driver = webdriver.Chrome(service=Service(driver_bin), options=opts)
        setup_s = time.time() - started
        # the token goes into the origin's storage from a page that reads nothing (api.token guards the
        # dashboard's reads too), so the dashboard's first poll already carries it
        driver.get(api + "/health")
        driver.execute_script("localStorage.setItem('tandem-token', arguments[0])", TOKEN)
        driver.get_log("browser")  # drained: that page's own favicon 404 is not the dashboard's
        driver.get(api + "/")
        yield {"driver": driver, "api": api, "proc": proc, "dir": d, "model": warm_model_dir,
               "browser_start_s": setup_s}
    finally:
        if driver is not None:
            driver.quit()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)


def _points(driver, key: str) -> dict[str, int]:
    el = driver.find_element("css selector", f'.chart[data-key="{key}"]')
    return json.loads(el.get_attribute("data-points") or "{}")


def _status(live) -> dict:
    return httpx.get(f"{live['api']}/v1/status", timeout=5, headers=AUTH).json()


def test_charts_hold_points_for_both_agents_and_grow(live):
    driver, proc = live["driver"], live["proc"]
    first = _wait(lambda: (p := _points(driver, "reward")) and all(p.get(a, 0) > 0 for a in "AB") and p, 300,
                  "reward points for both agents", proc)
    grown = _wait(lambda: (p := _points(driver, "reward")) and all(p[a] > first[a] for a in "AB") and p, 240,
                  "the reward chart to grow for both agents", proc)
    steps = _wait(lambda: (p := _points(driver, "train-pg_loss-step")) and all(p.get(a, 0) > 0 for a in "AB") and p,
                  240, "train-step points for both agents", proc)
    assert grown["A"] > first["A"] and grown["B"] > first["B"] and steps["A"] >= 1
    # what the page plots is what the API holds (at least as many points as were on the page)
    metrics = httpx.get(f"{live['api']}/v1/metrics", timeout=5, headers=AUTH).json()
    assert all(len(metrics[a]["group_rewards"]) >= grown[a] for a in "AB")
    assert driver.find_elements("css selector", '.chart[data-key="eval"] canvas')
    assert not driver.find_elements("css selector", ".chart.failed")
    every_chart = driver.find_elements("css selector", ".chart")
    assert all(c.find_elements("css selector", "canvas") for c in every_chart), "a chart did not draw"
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"
              and "/favicon.ico " not in e["message"]]  # the /health page's own favicon, logged late under load
    assert not errors, errors  # no script error on the page
    _check_charts(driver, lambda: _status(live))


def _check_charts(driver, read_status) -> list[dict]:
    """No tick label cut off or repeated; every title human, naming what the chart plots (the eval chart its
    opponent); the step axes from 0 to the run's newest step (``read_status()``: /v1/status now)."""
    status = read_status()
    opponents = [o for e in status["evals"] for o in e.get("opponents", [])]
    assert opponents
    named = f"Held-out eval score vs {opponents[0]} ("  # once the page polled an evaluation
    drawn = _wait(lambda: (c := charts(driver)) and all(ch["y"]["labels"] for ch in c)
                  and any(ch["key"] == "eval" and ch["title"].startswith(named) for ch in c) and c, 30, "drawn charts")
    problems = [p for ch in drawn for p in axis_problems(ch) + title_problems(ch)]
    assert not problems, problems
    by_key = {ch["key"]: ch for ch in drawn}
    assert "scripted" not in by_key["eval"]["title"] or opponents[0] == "scripted"
    assert by_key["train-tokens_per_s-step"]["title"] == "Trainer throughput (tokens / s)"
    assert "tokens_per_s" in by_key["train-tokens_per_s-step"]["tooltip"]
    newest = max(a["step"] for a in read_status()["agents"].values())  # read after the page drew
    for key, ch in by_key.items():
        if key.startswith(("train-", "eval", "illegal", "reward")):
            assert ch["x_min"] == 0 and 1 <= ch["x_max"] <= newest + 1, (key, ch["x_min"], ch["x_max"], newest)
    return drawn


def _click_first_episode(driver, tries: int = 20) -> str:
    """Click the newest episode's row; the list is redrawn every 2 s, so a row found a moment ago may be
    gone (stale) by the click: find it again."""
    for _ in range(tries):
        try:
            row = driver.find_elements("css selector", "#episodes tbody tr")[0]
            episode_id = row.get_attribute("data-episode")
            row.click()
            return episode_id
        except StaleElementReferenceException:
            time.sleep(0.1)
    raise AssertionError(f"the episode list was redrawn under every one of {tries} clicks")


def test_opening_a_transcript_shows_its_turns_and_rewards(live):
    driver = live["driver"]
    _wait(lambda: driver.find_elements("css selector", "#episodes tbody tr"), 60, "the episode list", live["proc"])
    episode_id = _click_first_episode(driver)
    turns = _wait(lambda: driver.find_elements("css selector", "#episode tr.turn"), 30, "the episode's turns")
    rec = httpx.get(f"{live['api']}/v1/episodes/{episode_id}", timeout=5, headers=AUTH).json()
    assert len(turns) == len(rec["turns"]) > 0
    assert [t.get_attribute("data-role") for t in turns] == [t["role"] for t in rec["turns"]]
    final = driver.find_element("css selector", "#episode .final-rewards").text
    for role, reward in rec["rewards"].items():
        assert f"{role} {reward:.2f}" in final
    assert driver.find_elements("css selector", "#episode .board table.ttt-board")  # the env's rendering
    # each turn's reward column: what the turn earned its role; a role's turns add up to its final reward
    credits = {}
    for row in turns:
        cell = row.find_element("css selector", "td.credit").text
        assert cell and cell != "-", row.text
        credits.setdefault(row.get_attribute("data-role"), []).append(float(cell.split(",")[0]))
    assert credits and set(credits) <= set(rec["rewards"]), (credits, rec["rewards"])
    for role, earned in credits.items():  # a role with no turn (its game ended before its first) shows none
        assert abs(sum(earned) - rec["rewards"][role]) < 0.02, (role, credits, rec["rewards"])
    # the list holds still while an episode is open, through several polls (the run keeps playing)
    listed = [r.get_attribute("data-episode") for r in driver.find_elements("css selector", "#episodes tbody tr")]
    polls = int(driver.find_element("tag name", "body").get_attribute("data-polls"))
    _wait(lambda: int(driver.find_element("tag name", "body").get_attribute("data-polls")) >= polls + 4, 30, "polls")
    rows = driver.find_elements("css selector", "#episodes tbody tr")
    assert [r.get_attribute("data-episode") for r in rows] == listed
    assert driver.find_element("css selector", "#episodes tr.selected").get_attribute("data-episode") == episode_id
    driver.find_element("id", "show-tokens").click()
    tokens = _wait(lambda: driver.find_elements("css selector", "#episode span.token"), 30, "the reply tokens")
    assert "logprob" in tokens[0].get_attribute("title")


def test_archived_transcripts_can_be_browsed_and_the_page_fits_1400_and_800_px(live):
    driver, api = live["driver"], live["api"]
    archive = live["dir"] / "runs" / "dash" / "transcripts.jsonl.gz"  # run.transcripts_kept 4: older ones spill
    _wait(lambda: archive.is_file(), 240, "the transcript archive", live["proc"])
    listed = httpx.get(f"{api}/v1/dashboard/episodes", params={"source": "archive", "limit": 5}, headers=AUTH,
                       timeout=10).json()
    assert listed["total"] >= 1 and listed["source"] == "archive"
    driver.execute_script("const s = document.querySelector('#filters [name=source]'); s.value = 'archive';"
                          "s.dispatchEvent(new Event('change', {bubbles: true}));")
    _wait(lambda: "archived episodes" in driver.find_element("id", "episode-count").text, 30, "the archive list")
    first = driver.find_elements("css selector", "#episodes tbody tr")[0]
    archived_id = first.get_attribute("data-episode")
    # the run goes on spilling episodes into the archive: the page's list is checked against the API's after it
    after = httpx.get(f"{api}/v1/dashboard/episodes", params={"source": "archive", "limit": 50}, headers=AUTH,
                      timeout=10).json()
    assert archived_id in {e["id"] for e in after["episodes"]} and after["total"] >= listed["total"]
    first.click()  # the episode opened before is replaced by the archived one
    _wait(lambda: archived_id.startswith(driver.find_element("css selector", "#episode h3 .mono").text), 30,
          "the archived episode")
    assert driver.find_elements("css selector", "#episode tr.turn")
    for width in (1400, 800):
        shot = screenshot(driver, width, f"dashboard-{width}.png")
        assert shot.stat().st_size > 20_000
        _check_charts(driver, lambda: _status(live))
        _no_sideways_scroll(driver, width)
    driver.set_window_size(1400, 2200)


# the elements that reach past the page's right edge, widest first (what a failure names)
OVERFLOWING = """const w = document.documentElement.clientWidth; return [...document.querySelectorAll('body *')]
  .map(e => [Math.round(e.getBoundingClientRect().right), e.tagName + (e.id ? '#' + e.id : '') +
             (e.className && typeof e.className === 'string' ? '.' + e.className.split(' ').join('.') : '')])
  .filter(([r]) => r > w).sort((a, b) => b[0] - a[0]).slice(0, 8);"""


def _no_sideways_scroll(driver, width: int) -> None:
    """The page is no wider than the window once its layout has settled (the charts take their new width from a
    ResizeObserver, a frame or more after the window's change); a failure names what overflows."""
    try:
        _wait(lambda: driver.execute_script("return document.documentElement.scrollWidth") <= width, 10,
              f"a page no wider than {width} px")
    except AssertionError:
        raise AssertionError(f"the page scrolls sideways at {width} px: "
                             f"{driver.execute_script(OVERFLOWING)}") from None


def _click(driver, cmd: str) -> str:
    driver.execute_script("document.getElementById('control-msg').dataset.status = ''")
    driver.find_element("css selector", f'button[data-cmd="{cmd}"]').click()
    return _wait(lambda: driver.find_element("id", "control-msg").get_attribute("data-status"), 30, f"{cmd}'s answer")


def test_a_control_without_the_token_is_refused(live):
    driver = live["driver"]
    driver.find_element("id", "token").clear()
    assert _click(driver, "pause") == "401"
    assert "refused (401)" in driver.find_element("id", "control-msg").text
    assert _status(live)["paused"] is False


def test_pause_and_resume_from_the_page_change_the_status(live):
    driver = live["driver"]
    driver.find_element("id", "token").send_keys(TOKEN)
    assert _click(driver, "pause") == "200"
    assert _status(live)["paused"] is True
    _wait(lambda: driver.find_element("id", "run-state").get_attribute("data-paused") == "true", 30, "paused pill")
    driver.save_screenshot(str(live["dir"] / "dashboard.png"))
    assert (live["dir"] / "dashboard.png").stat().st_size > 20_000
    assert _click(driver, "resume") == "200"
    assert _status(live)["paused"] is False


def test_tensorboard_and_wandb_logs_of_the_run(live):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    api, proc = live["api"], live["proc"]
    assert httpx.post(f"{api}/v1/stop", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).status_code == 200
    assert proc.wait(180) == 0, (live["dir"] / "launcher.log").read_text()[-3000:]
    run = live["dir"] / "runs" / "dash"
    metrics = json.loads((run / "metrics.json").read_text())
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for agent in ("A", "B"):
        steps = metrics[agent]["train_steps"]
        keys = {k for s in steps for k, v in s.items() if isinstance(v, int | float) and not isinstance(v, bool)
                and k not in ("weight_version", "time")}
        for key in keys:
            assert f"{agent}/train/{key}" in tags
        # every step the report holds (a step that ends after the report may be logged too)
        assert {e.step for e in acc.Scalars(f"{agent}/train/pg_loss")} >= {s["weight_version"] for s in steps}
        groups = sum(e.value for e in acc.Scalars(f"{agent}/reward/groups"))
        assert groups >= len(metrics[agent]["group_rewards"])
        assert f"{agent}/eval_random/score" in tags and f"{agent}/eval/score" not in tags
        for key in ("queue_depth", "weight_version", "groups_kept"):
            assert f"{agent}/pipeline/{key}" in tags
    # one step axis: every scalar is at a weight version the agent reached, under one section per kind
    for tag in tags:
        agent, section, _ = tag.split("/", 2)
        top = max(e.step for e in acc.Scalars(f"{agent}/train/pg_loss"))  # its newest version (after the report too)
        assert section in ("train", "reward", "play", "pipeline") or section.startswith("eval_"), tag
        events = acc.Scalars(tag)
        assert all(0 <= e.step <= top for e in events), (tag, [e.step for e in events], top)
        if section == "pipeline":  # the newest trained version when sampled; its wall time says when
            assert [e.step for e in events] == sorted(e.step for e in events), tag
            assert [e.wall_time for e in events] == sorted(e.wall_time for e in events), tag
    assert any(t.startswith("transcripts/") for t in acc.Tags()["tensors"])
    offline = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert offline and offline[0].stat().st_size > 0


def test_compare_two_runs_writes_png_and_table(live):
    d = live["dir"]
    port = free_port()
    proc = _launch(_config(d, "dash2", live["model"], port, steps=2, eval_episodes=2), d / "launcher2.log")
    assert proc.wait(400) == 0, (d / "launcher2.log").read_text()[-3000:]
    out = d / "cmp"
    done = subprocess.run([sys.executable, "-m", "services.launcher.cli", "compare", "dash", "dash2",
                           "--dir", str(d / "runs"), "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (out / "compare.png").stat().st_size > 10_000
    table = (out / "compare.md").read_text()
    assert table.count("| dash | ") == 2 and table.count("| dash2 | ") == 2
    listed = subprocess.run([sys.executable, "-m", "services.launcher.cli", "runs", "--dir", str(d / "runs")],
                            cwd=REPO, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert listed.returncode == 0 and "dash2" in listed.stdout and "stopped" in listed.stdout


def _files(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def test_tandem_dashboard_serves_a_finished_run_read_only(live):
    """``tandem dashboard dash2`` (the 2-step run the compare test finished): the page and its data from the
    run's files and Redis AOF, controls refused, nothing under the run directory written."""
    d, driver = live["dir"], live["driver"]
    run = d / "runs" / "dash2"
    before = _files(run)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "dashboard", "dash2", "--dir",
                             str(d / "runs"), "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url, lines = f"http://127.0.0.1:{port}/", []
        while not lines or ("http://" not in lines[-1] and lines[-1] and len(lines) < 50):
            lines.append(proc.stdout.readline())  # the URL line (after any warning of the imports)
        line = lines[-1]
        assert "read-only" in line and url in line, line
        api = url.rstrip("/")
        _wait(lambda: httpx.get(f"{api}/health", timeout=2).status_code == 200, 60, "the run's dashboard", proc)
        info = httpx.get(f"{api}/v1/dashboard/info", timeout=5).json()
        assert info["read_only"] is True and info["run"] == "dash2" and info["total_steps"] == 2
        assert httpx.get(f"{api}/v1/metrics", timeout=5).json() == json.loads((run / "metrics.json").read_text())
        summary = json.loads((run / "summary.json").read_text())
        status = httpx.get(f"{api}/v1/status", timeout=5).json()
        assert status["phase"] == summary["phase"] and status["evals"] == summary["evals"]
        for cmd in ("pause", "stop", "eval", "checkpoint"):
            assert httpx.post(f"{api}/v1/{cmd}", timeout=5).status_code == 405
        recent = httpx.get(f"{api}/v1/dashboard/episodes", params={"limit": 500}, timeout=5).json()
        assert recent["total"] >= 1  # the transcripts its Redis held, read from the AOF
        ep = httpx.get(f"{api}/v1/dashboard/episodes/{recent['episodes'][0]['id']}", timeout=5).json()
        assert ep["turns"] and ep["board"]
        driver.set_window_size(1400, 2200)
        driver.get(url)
        _wait(lambda: (p := _points(driver, "reward")) and all(p.get(a, 0) > 0 for a in "AB"), 30, "the charts")
        assert driver.find_element("id", "controls").is_displayed() is False
        assert "read-only" in driver.find_element("id", "run-state").text
        drawn = _check_charts(driver, lambda: status)
        for ch in drawn:  # a 2-step run's step axes span its 2 steps
            if ch["key"].startswith(("train-", "illegal", "eval")):
                assert (ch["x_min"], ch["x_max"]) == (0, 2), ch["key"]
        assert screenshot(driver, 1400, "dashboard-finished-1400.png").stat().st_size > 20_000
    finally:
        proc.terminate()
        proc.wait(30)
    assert _files(run) == before  # read-only: no file under the run directory added or changed
