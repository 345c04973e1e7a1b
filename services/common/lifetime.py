"""Child processes that never outlive their parent: the parent-death signal (Linux ``PR_SET_PDEATHSIG``).

Pass ``die_with_parent()`` as ``preexec_fn`` to ``subprocess.Popen`` or ``asyncio.create_subprocess_exec``:
when the process that started the child dies (even by SIGKILL), the kernel sends the child SIGTERM.
The signal follows the *thread* that forked the child, so start long-lived children from a thread that
lives as long as the parent (the main thread, or the event loop's thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _arm(parent: int, sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no parent-death signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died between fork and prctl: the signal would never come
        os._exit(1)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when this process (the caller) dies."""
    return functools.partial(_arm, os.getpid(), sig)
