"""Bookkeeping after faults: half-written weights directories cleaned at trainer start, the restart-budget
message naming ``--resume``, SIGINT handled by ``tandem up`` even when inherited as ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
