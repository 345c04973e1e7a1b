"""The main loop of ``tandem up``: supervise the children, start the deferred ones, show the live view.

It reads the coordinator's ``/v1/status`` (validated as a ``RunStatus``, services/contracts/status.py) for
the live view (services/launcher/live_view.py), the evaluations and the engine restarts, checks the disks,
and ends when the coordinator exits 0.
"""

from __future__ import annotations

import threading
import time

import httpx
from rich.console import Console
from rich.live import Live

from services.common.admin_token import bearer
from services.contracts.status import RunStatus
from services.launcher.deferred import AfterFirstTurn
from services.launcher.disk import DiskWatch
from services.launcher.live_view import eval_table, new_evals, status_table
from services.launcher.processes import ProcessGroup
from services.launcher.progress import Progress
from services.launcher.restarts import EngineRestarts

DISK_CHECK_S = 5.0  # how often the launcher looks for a full disk


def watch(group: ProcessGroup, api: str, console: Console, token: str = "", engines: EngineRestarts | None = None,
          later: AfterFirstTurn | None = None, disk: DiskWatch | None = None) -> int:
    """Supervise the children (restart a dead one within the budget) and refresh progress until the
    coordinator exits 0; ``ServiceFailed`` when a service is past its restart budget. Once the status says
    the run is over (``done`` or ``stopped``) only the coordinator is still restarted: it writes the report
    and stops the others, and a service that dies then is not started again."""
    waiter = threading.Event()
    status = None
    progress = Progress()
    last_print = 0.0
    started = time.time()
    announced, disk_checked = False, 0.0
    evals_shown: set[tuple[str, float]] = set()
    with Live(status_table(None), console=console, auto_refresh=False,
              transient=False) if console.is_terminal else _NoLive() as live:
        while True:
            for name, cmd in later.take_due() if later else []:
                group.start(name, cmd)
            for note in group.supervise():
                console.print(f"[yellow]{note}[/yellow]", soft_wrap=True)
            if engines is not None and engines.ledger.pending:
                engines.ledger.flush()  # restarts counted while Redis itself was restarting
            if disk is not None and time.monotonic() - disk_checked >= DISK_CHECK_S:
                disk.check()  # "disk full at PATH", once per fault (launcher/disk.py)
                disk_checked = time.monotonic()
            if group.exited("coordinator") == 0:
                return 0
            try:
                reply = httpx.get(f"{api}/v1/status", timeout=2.0, headers=bearer(token)).json()
                phase = RunStatus.model_validate(reply).phase  # the status contract, else a ValueError
                status = reply
                if not announced:
                    console.print(f"all services up in {time.time() - started:.0f}s: dashboard at {api}/, control "
                                  f"API docs at {api}/docs", soft_wrap=True)
                    announced = True
                for ev in new_evals(status, evals_shown):
                    console.print(eval_table(ev))
                progress.update(status)
                if engines is not None:
                    engines.update(status)
                if phase in ("done", "stopped"):
                    group.winding_down.set()
            except (httpx.HTTPError, ValueError):
                pass
            restarts = group.restart_counts()
            if console.is_terminal:
                live.update(status_table(status, restarts, progress), refresh=True)
            elif status and time.time() - last_print > 15:
                console.print(status_table(status, restarts, progress))
                last_print = time.time()
            (later.due if later and later.pending else waiter).wait(1.0)


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
