"""The dashboard in a real headless Chromium against a live ``tandem up`` (Debian's chromium + chromedriver,
installed by ``make browser``, which ``make test`` runs).

Checks, in file order on one run (api.token configured): the charts hold points for both agents and
grow while the run goes on; opening a transcript shows the episode's turns, rewards and (on demand) its
tokens; a control action without the token is refused; pause and resume from the page change
``/v1/status``. A screenshot is saved under the test's temp dir. After the run is stopped from the API,
TensorBoard's own EventAccumulator finds every scalar series, W&B (offline) has written its run
directory, and ``tandem compare`` over this run and a second short one writes the PNG and the table.
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
from tests.helpers import launch_up, wait_until

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TOKEN = "dash-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    errors = (httpx.HTTPError, KeyError, ValueError, WebDriverException)  # e.g. a chart not drawn yet
    return wait_until(predicate, timeout, what, proc, errors=errors, interval=0.3)


def _config(d: Path, name: str, model: Path, port: int, steps: int, **extra) -> Path:
    cfg = {
        "run": {"name": name, "total_steps": steps, "concurrent_episodes": 8, "checkpoint_root": str(d / "ckpt"),
                "output_dir": str(d / "runs")},
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
                           api={"token": TOKEN}, logging={"wandb": {"project": "tandem-test", "mode": "offline"}}),
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
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors  # no script error on the page


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
    driver.find_element("id", "show-tokens").click()
    tokens = _wait(lambda: driver.find_elements("css selector", "#episode span.token"), 30, "the reply tokens")
    assert "logprob" in tokens[0].get_attribute("title")


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
