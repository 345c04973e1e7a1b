"""One run, one stack (services/launcher/run_lock.py): a second ``tandem up`` or ``--resume`` of a live run is
refused naming the live launcher, before it touches anything; a SIGKILLed launcher leaves no stuck lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.contracts.config import parse_config
from services.launcher import run_lock
from tests.helpers import REPO, launch_up, run_up


def _config(tmp_path: Path, model: Path, name: str) -> Path:
    cfg = {"run": {"name": name, "total_steps": 50, "checkpoint_root": str(tmp_path / "ckpt"),
                   "output_dir": str(tmp_path / "runs")},
           "api": {"port": 0},  # a free port each: nothing else would stop a second stack
           "environment": {"name": "tictactoe", "group_size": 2, "roles": {"X": "A", "O": "B"}},
           "agents": {a: {"model_path": str(model), "groups_per_batch": 2, "max_no_signal_steps": 0}
                      for a in ("A", "B")}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _holder(lock: Path, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if lock.exists() and lock.read_text():
            return json.loads(lock.read_text())
        time.sleep(0.1)
    raise AssertionError(f"no launcher took {lock}")


def test_a_lock_whose_holder_died_is_free(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _config(tmp_path, tiny_model_dir, "held")
    cfg = parse_config(yaml.safe_load(path.read_text()))
    code = ("import sys, time, yaml; from services.contracts.config import parse_config; "
            "from services.launcher import run_lock; "
            f"run_lock.acquire(parse_config(yaml.safe_load(open({str(path)!r}))), {str(path)!r}); "
            "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.RunIsLive, match=rf"run 'held' is live: .*pid {holder.pid}"):
            run_lock.check_live(cfg)
        os.kill(holder.pid, signal.SIGKILL)  # a crashed launcher
        holder.wait(10)
        run_lock.check_live(cfg)  # free: the kernel dropped the lock with its process
        assert run_lock.acquire(cfg, str(path)) == run_lock.lock_path(cfg)
        run_lock.release(cfg)
    finally:
        holder.kill()


@pytest.mark.slow
def test_a_second_up_or_resume_of_a_live_run_is_refused_naming_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Issue 33: a --resume of a live run (api.port: 0) started a second stack on the same AOF."""
    path = _config(tmp_path, tiny_model_dir, "live")
    lock = tmp_path / "runs" / ".live.lock"
    with (tmp_path / "first.log").open("w") as log:
        first = launch_up(path, stdout=log, text=True)
    try:
        who = _holder(lock)
        assert who["pid"] == first.pid and who["run"] == "live"
        for flags in (("--resume",), ()):
            started = time.monotonic()
            res = run_up(path, *flags)
            assert res.returncode == run_lock.RUN_IS_LIVE, (flags, res.stderr)
            assert f"run 'live' is live: `tandem up {path}` (pid {first.pid}" in res.stderr, res.stderr
            assert time.monotonic() - started < 60
        assert first.poll() is None  # the live run is untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    run_lock.check_live(parse_config(yaml.safe_load(path.read_text())))  # the killed launcher's lock is free
