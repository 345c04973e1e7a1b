"""A model process's start-up with Python's cyclic garbage collector held off.

Importing torch and transformers and building a model make a few hundred thousand objects that live as
long as the process; the collector's passes over them while they are made cost about a sixth of the
start's CPU time (docs/results/system.md, "Start-up without the collector"). ``startup()`` turns the
collector off for the block, then freezes everything alive (``gc.freeze``: later collections skip those
objects) and turns it back on as it was.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup() -> Iterator[None]:
    """The block runs without cyclic collections; what it leaves alive is frozen out of later ones."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
