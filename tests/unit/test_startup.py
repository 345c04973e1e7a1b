"""A model process's start-up block: no cyclic collection inside it, what it leaves alive frozen after it, and the
collector back as it was (services/common/startup.py)."""

from __future__ import annotations

import gc

import pytest

from services.common.startup import startup


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_block_runs_without_the_collector_and_freezes_what_it_made() -> None:
    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    try:
        with startup():
            assert not gc.isenabled()
            kept = [Node() for _ in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(kept)
    finally:
        gc.unfreeze()


def test_a_disabled_collector_stays_disabled_and_an_error_still_restores_it() -> None:
    try:
        gc.disable()
        with startup():
            pass
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(RuntimeError), startup():
            raise RuntimeError("a failed model load")
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
