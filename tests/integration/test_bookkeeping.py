"""Bookkeeping after faults: half-written weights directories cleaned at trainer start, the restart-budget
message naming ``--resume``, SIGINT handled by ``tandem up`` even when inherited as ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.common.bus import Bus
from services.contracts.config import parse_config
from services.trainer.service import TrainerService


class SavingPolicy:
    """Only the policy calls a trainer's start makes (version 0's state written as a directory)."""

    def save_state(self, path: Path, version: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        return path

    def load_state(self, path: Path) -> None:
        raise AssertionError("nothing is published: nothing to load")


async def test_a_trainer_start_removes_every_half_written_weights_directory(redis_url: str, tmp_path: Path,
                                                                            tiny_model_dir: Path) -> None:
    cfg = parse_config({"run": {"name": "tidy", "checkpoint_root": str(tmp_path / "ck")}, "redis_url": redis_url,
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir)}}})
    ckpt = tmp_path / "ck" / "tidy" / "A"
    left = [ckpt / "v00003.tmp4242", ckpt / "v00004.tmp-megatron"]  # a SIGKILL mid-save (torch, megatron)
    for d in left:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "model.safetensors").write_bytes(b"x" * 1000)
    kept = ckpt / "v00002"
    kept.mkdir()
    bus = Bus(redis_url, "tidy", "trainer-A")
    policy: Any = SavingPolicy()
    trainer = TrainerService(cfg, "A", bus, policy)
    await trainer.resume()
    assert not any(d.exists() for d in left) and kept.is_dir()
    await bus.close()


def test_the_log_pump_survives_a_full_disk(tmp_path: Path) -> None:
    """A child's log on a full disk (/dev/full answers every write with ENOSPC): its output is still drained
    (a child blocked on a full pipe would hang) and shown, and the failure is said once."""
    import sys

    from services.launcher.processes import ProcessGroup

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "chatty.log").symlink_to("/dev/full")
    shown: list[str] = []
    group = ProcessGroup(logs, {}, lambda name, line: shown.append(line))
    child = group.start("chatty", [sys.executable, "-c", "for i in range(20000): print('line', i, 'x' * 40)"])
    assert child.proc.wait(60) == 0  # 1 MB through a 64 KB pipe: drained to the end
    child.pump.join(10)
    assert shown[-1] == "line 19999 " + "x" * 40
    assert sum("cannot write its log (No space left on device" in s for s in shown) == 1


@pytest.mark.slow
def test_sigint_stops_a_launcher_that_inherited_it_ignored(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A script's background job inherits SIGINT ignored, and Python then installs no handler: ``tandem up``
    installs its own, so SIGINT stops the run as Ctrl-C does (exit 130, naming --resume)."""
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from tests.helpers import REPO

    cfg = {"run": {"name": "sigint", "total_steps": 50, "checkpoint_root": str(tmp_path / "ck"),
                   "output_dir": str(tmp_path / "runs")}, "api": {"port": 0},
           "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
           "agents": {"A": {"model_path": str(tiny_model_dir)}}}
    path = tmp_path / "sigint.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        lock = tmp_path / "runs" / ".sigint.lock"
        deadline = time.time() + 120
        while not (lock.exists() and lock.read_text()) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the handlers are installed right after the lock is taken
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted" in out and "--resume" in out
