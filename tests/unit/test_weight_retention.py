"""Checkpoint retention (``run.checkpoint_retention``): which weight versions a trainer prunes after a commit,
on real directories, and the config's floor. The trainer applying it across a kill and resume is
tests/e2e/test_trainer_resume.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.weight_retention import prune_weight_versions, versions_to_prune, weight_versions
from services.contracts.config import CheckpointRetention, ConfigError, parse_config


def rule(keep_last: int, keep_every: int = 0) -> CheckpointRetention:
    return CheckpointRetention(keep_last=keep_last, keep_every=keep_every)


def test_keep_last_every_kth_and_the_evaluated_versions():
    versions = list(range(1, 13))
    assert versions_to_prune(versions, 12, rule(0), 0) == []  # 0 keeps every version
    assert versions_to_prune(versions, 12, rule(3), 0) == list(range(1, 10))
    assert versions_to_prune(versions, 12, rule(3, keep_every=5), 0) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert versions_to_prune(versions, 12, rule(3), eval_every=4) == [1, 2, 3, 5, 6, 7, 9]
    assert versions_to_prune(versions, 9, rule(3), 0) == list(range(1, 7))  # newer than committed: untouched


def test_prune_deletes_only_pruned_version_directories(tmp_path: Path):
    for v in range(1, 8):
        (tmp_path / f"v{v:05d}").mkdir()
        (tmp_path / f"v{v:05d}" / "model.safetensors").write_bytes(b"w")
    (tmp_path / "state").mkdir()
    (tmp_path / "train_log.jsonl").write_text("{}\n")
    assert prune_weight_versions(tmp_path, 7, rule(3), eval_every=2) == [1, 3]
    assert weight_versions(tmp_path) == [2, 4, 5, 6, 7]
    assert (tmp_path / "state").is_dir() and (tmp_path / "train_log.jsonl").is_file()
    assert prune_weight_versions(tmp_path, 7, rule(3), eval_every=2) == []  # idempotent


def base_config(**run: object) -> dict:
    return {"run": {"name": "r", **run}, "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
            "agents": {"A": {"model_path": "m"}}}


def test_keep_last_below_what_is_still_loaded_fails_at_start_naming_the_field():
    assert parse_config(base_config(checkpoint_retention={"keep_last": 2}), "x").run.checkpoint_retention.keep_last == 2
    with pytest.raises(ConfigError, match=r"run.checkpoint_retention.keep_last: 1 is below 2"):
        parse_config(base_config(checkpoint_retention={"keep_last": 1}), "x")
    pooled = base_config(checkpoint_retention={"keep_last": 3})
    pooled["environment"].update(roles={"X": "A", "O": "pool:A"}, pool_size=4)
    with pytest.raises(ConfigError, match=r"keep_last: 3 is below 4"):
        parse_config(pooled, "x")
    with pytest.raises(ConfigError, match="keep_last"):
        parse_config(base_config(checkpoint_retention={"keep_last": -1}), "x")
