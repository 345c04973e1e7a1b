"""Helpers for the real SGLang router (``sglang-router`` 0.3.2, Rust, runs on CPU).

Findings, measured against sglang-router 0.3.2 with a request-logging worker:

* Registering a worker (at start-up from ``--worker-urls`` or at run time) is a
  background workflow: ``GET /health`` (HTTP-vs-gRPC detection; it also sends
  a gRPC probe, which uvicorn logs as "Invalid HTTP request received"), then
  ``GET /server_info`` and ``GET /model_info`` (the newer SGLang names, not
  ``/get_*``) for metadata labels: ``model_path``, ``served_model_name``,
  ``tp_size``, ``dp_size``, ``load_balance_method``, ``disaggregation_mode``,
  ``model_type``, ``architectures``. With no ``--model-path``/``--tokenizer-path``
  it then loads the tokenizer from the worker's ``tokenizer_path``/``model_path``
  (a local directory); a worker without them is still registered (model id
  "unknown") and a tokenizer is not needed for ``/generate`` with ``input_ids``.
* Health: ``GET /health`` every ``--health-check-interval-secs`` (default 60).
  Load: ``GET /get_load`` (router ``GET /get_loads`` and a 30 s monitor), read as
  SGLang's list ``[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]``;
  the load is the sum of ``num_tokens`` (-1 when it cannot parse the reply).
  Router ``GET /get_model_info`` is proxied to a worker's ``/get_model_info``.
* ``POST /generate`` is forwarded with only the fields the router knows, plus
  its own defaults: ``model`` (null), ``return_text_in_logprobs``,
  ``log_metrics``, ``return_hidden_states``, ``background``, ``no_logs``,
  ``return_bytes``, ``return_entropy``; unknown top-level fields are dropped.
  Only the sampling params that were given are forwarded.
* Worker admin API: ``GET /workers`` -> ``{"workers": [{"id", "url",
  "is_healthy", "load", ...}], "total", "stats"}``; ``POST /workers`` with
  ``{"url": ...}`` -> 202 (queued; the worker appears once registered);
  ``GET/DELETE /workers/{id}`` (202, queued). ``/add_worker``,
  ``/remove_worker`` and ``/list_workers`` answer 404 (not served by this version).
* Start-up: no tokenizer or GPU is needed. ``--worker-startup-check-interval``
  defaults to 30 s (a worker not up at the first probe waits that long) and
  Prometheus binds 0.0.0.0:29000 by default (a second router would clash), so
  ``router_command`` sets a 1 s check interval and a Prometheus port of its own.
* Authentication (docs/architecture.md §2.3): ``--control-plane-api-keys 'id:name:admin:KEY'`` makes
  ``/workers`` (GET and POST, DELETE) answer 401 without ``Authorization: Bearer KEY``; ``--api-key KEY``
  makes the data plane (``/generate``, ``/get_loads``, ``/flush_cache``...) require it too, and the
  router sends it to its workers. ``/health`` stays open. The Rust router reads keys only from its
  arguments (no environment variable, no file), but it runs inside our Python wrapper
  (``sglang_router_main``), which hands them to it in process: with an ``admin_token``, ``router_command``
  adds only ``--admin-token-from-env`` and the wrapper sets both keys to ``$TANDEM_ADMIN_TOKEN``, so no key
  is in the process list. It binds 127.0.0.1 unless the config names another host.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import httpx

from services.common.admin_token import bearer
from services.common.embedded_redis import free_port

ADMIN_TOKEN_FROM_ENV = "--admin-token-from-env"  # sglang_router_main's own flag: the keys from the environment


def router_command(port: int, worker_urls: list[str], policy: str = "round_robin", host: str = "127.0.0.1",
                   prometheus_port: int | None = None, log_level: str = "warn",
                   startup_timeout_s: int = 120, health_interval_s: int = 5,
                   admin_token: str | None = None) -> list[str]:
    """The command line that starts the SGLang router in front of ``worker_urls`` (with ``admin_token``:
    its worker admin API and its data plane need that bearer token, which the caller puts in the router's
    environment as ``$TANDEM_ADMIN_TOKEN``; ``spawn`` does)."""
    cmd = [sys.executable, "-m", "services.common.sglang_router_main", "--host", host, "--port", str(port),
           "--policy", policy, "--worker-startup-check-interval", "1",
           "--worker-startup-timeout-secs", str(startup_timeout_s),
           "--health-check-interval-secs", str(health_interval_s),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port or free_port()),
           "--log-level", log_level]
    if admin_token:  # never on the command line: the router's wrapper reads it from $TANDEM_ADMIN_TOKEN
        cmd += [ADMIN_TOKEN_FROM_ENV]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    return cmd


def _norm(url: str) -> str:
    return url.rstrip("/")


async def wait_healthy(url: str, timeout: float = 30.0, path: str = "/health") -> None:  # noqa: ASYNC109
    """Poll ``GET {url}{path}`` until it answers 200; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: str = "no answer"
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                resp = await client.get(_norm(url) + path)
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url}{path} not healthy after {timeout:.0f}s ({last})")


async def _workers(client: httpx.AsyncClient, router_url: str) -> list[dict[str, Any]]:
    resp = await client.get(_norm(router_url) + "/workers")
    resp.raise_for_status()
    return list(resp.json().get("workers", []))


async def list_workers(router_url: str, healthy_only: bool = False, token: str | None = None) -> list[str]:
    """The router's worker URLs (from ``GET /workers``)."""
    async with httpx.AsyncClient(timeout=5.0, headers=bearer(token)) as client:
        workers = await _workers(client, router_url)
    return [_norm(w["url"]) for w in workers if w.get("is_healthy", True) or not healthy_only]


async def add_worker(router_url: str, worker_url: str, timeout: float = 30.0,  # noqa: ASYNC109
                     token: str | None = None) -> None:
    """Register ``worker_url`` (``POST /workers``) and wait until the router lists it healthy."""
    async with httpx.AsyncClient(timeout=5.0, headers=bearer(token)) as client:
        resp = await client.post(_norm(router_url) + "/workers", json={"url": _norm(worker_url)})
        if resp.status_code not in (200, 201, 202):
            raise RuntimeError(f"router refused worker {worker_url}: HTTP {resp.status_code} {resp.text}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(_norm(w["url"]) == _norm(worker_url) and w.get("is_healthy", True)
                   for w in await _workers(client, router_url)):
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"router {router_url} did not register {worker_url} within {timeout:.0f}s")


async def remove_worker(router_url: str, worker_url: str, timeout: float = 30.0,  # noqa: ASYNC109
                        token: str | None = None) -> None:
    """Deregister ``worker_url`` (``DELETE /workers/{id}``) and wait until it is gone."""
    async with httpx.AsyncClient(timeout=5.0, headers=bearer(token)) as client:
        ids = [w["id"] for w in await _workers(client, router_url) if _norm(w["url"]) == _norm(worker_url)]
        if not ids:
            raise KeyError(f"router {router_url} has no worker {worker_url}")
        for worker_id in ids:
            resp = await client.delete(f"{_norm(router_url)}/workers/{worker_id}")
            if resp.status_code not in (200, 202, 204):
                raise RuntimeError(f"router refused to remove {worker_url}: {resp.status_code} {resp.text}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(_norm(w["url"]) != _norm(worker_url) for w in await _workers(client, router_url)):
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"router {router_url} still lists {worker_url} after {timeout:.0f}s")
