"""The live web dashboard the coordinator serves at ``/`` (``mount(app, source, guard)``).

The page (``static/``: plain HTML, JavaScript and CSS, with the uPlot chart library vendored from
npm, see ``static/vendor/README.md``) needs no network beyond the coordinator itself. It polls
``/v1/status`` and ``/v1/metrics`` and the read-only ``/v1/dashboard/*`` routes below, and drives
the run through the control API's ``POST /v1/{pause,resume,stop,checkpoint,eval}`` with the
bearer token typed into the page. When ``api.token`` is configured the page sends that token with
its reads too: only the page, its assets and ``/v1/dashboard/info`` (which says a token is needed)
are open. What it reads is a ``DashboardSource`` (routes.py): the config, the environment, the run
state, the episodes and the players' tokenizers, not the coordinator. A finished run's page is served
read-only from its files by ``python -m services.coordinator.dashboard RUN_DIR`` (finished.py;
``tandem dashboard RUN``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from services.coordinator.dashboard.routes import DashboardSource, create_routes

STATIC = Path(__file__).parent / "static"


def mount(app: FastAPI, source: DashboardSource, guard: list[Any]) -> None:
    """Serve the dashboard page at ``/``, its assets under ``/dashboard/static`` and its data routes (those
    behind ``guard``, the API's token dependency)."""
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    create_routes(app, source, STATIC / "index.html", guard)


__all__ = ["DashboardSource", "mount"]
