"""The live web dashboard the coordinator serves at ``/`` (``mount(app, coord)``).

The page (``static/``: plain HTML, JavaScript and CSS, with the uPlot chart library vendored from
npm, see ``static/vendor/README.md``) needs no network beyond the coordinator itself. It polls
``/v1/status`` and ``/v1/metrics`` and the read-only ``/v1/dashboard/*`` routes below, and drives
the run through the control API's ``POST /v1/{pause,resume,stop,checkpoint,eval}`` with the
bearer token typed into the page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from services.coordinator.dashboard.routes import create_router

STATIC = Path(__file__).parent / "static"


def mount(app: FastAPI, coord: Any) -> None:
    """Serve the dashboard page at ``/``, its assets under ``/dashboard/static`` and its data routes."""
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    app.include_router(create_router(coord, STATIC / "index.html"))


__all__ = ["mount"]
