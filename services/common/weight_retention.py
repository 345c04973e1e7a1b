"""Checkpoint retention: which of an agent's weight versions (``<checkpoint_root>/<run>/<agent>/v#####``) stay
on disk once a newer version is committed (``run.checkpoint_retention``; the trainer prunes after each commit).

Kept: the newest ``keep_last`` versions up to the committed one, every ``keep_every``-th version, and the
versions the in-run evaluation plays (multiples of ``environment.eval.every_n_steps``: the evaluation of
version k may run after k + keep_last is committed, and the best-scored version is among them). Versions newer
than the committed one are never touched (the trainer's resume owns them). ``keep_last: 0`` keeps everything.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from services.contracts.config import CheckpointRetention


def weight_versions(ckpt_dir: Path) -> list[int]:
    """The weight versions written under ``ckpt_dir`` (``v#####`` directories), oldest first."""
    return sorted(int(p.name[1:]) for p in ckpt_dir.glob("v*") if p.is_dir() and p.name[1:].isdigit())


def versions_to_prune(versions: list[int], committed: int, rule: CheckpointRetention, eval_every: int) -> list[int]:
    """The versions ``rule`` lets go, given the committed version and the evaluation's period."""
    if not rule.keep_last:
        return []

    def kept(v: int) -> bool:
        return (v > committed - rule.keep_last or (rule.keep_every > 0 and v % rule.keep_every == 0)
                or (eval_every > 0 and v % eval_every == 0))

    return [v for v in versions if v <= committed and not kept(v)]


def prune_weight_versions(ckpt_dir: Path, committed: int, rule: CheckpointRetention, eval_every: int) -> list[int]:
    """Delete the versions ``rule`` lets go; return them. A half-deleted directory is finished next time."""
    gone = versions_to_prune(weight_versions(ckpt_dir), committed, rule, eval_every)
    for v in gone:
        shutil.rmtree(ckpt_dir / f"v{v:05d}", ignore_errors=True)
    return gone
