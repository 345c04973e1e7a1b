"""Prometheus series every Tandem process serves, declared and exposed with ``prometheus_client``.

Per process (the default registry, on every service's health port, ``GET /metrics``): the bus's dead
letters, handler counts and latency per stream, the trainer's skipped steps, and prometheus_client's
process, platform and GC collectors; ``record_start`` counts each service's starts in the run's
``SERVICE_STARTS`` hash. The per-run series (the coordinator's ``GET /metrics``) are in
services/coordinator/run_metrics.py; ``exposition`` renders either registry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder

T = TypeVar("T")

SERVICE_STARTS = "service_starts"  # the run's hash of service -> starts (Streams.key(SERVICE_STARTS))

DEAD_LETTERS = Counter("tandem_bus_dead_letters", "Entries this process sent to the dead-letter stream",
                       ["stream"])
HANDLED_SECONDS = Histogram("tandem_bus_handled_seconds", "Entries this process handled (count) and the time each "
                            "took, from decoding to the ack; outcome 'error' when handling itself raised",
                            ["stream", "group", "outcome"],
                            buckets=(.001, .005, .01, .05, .1, .5, 1, 5, 15, 60, 300, math.inf))
SKIPPED_STEPS = Counter("tandem_trainer_skipped_steps", "Training steps this trainer skipped: a non-finite loss, "
                        "gradient or weight (nothing was published for them)", ["agent"])


def count_dead_letter(stream: str) -> None:
    DEAD_LETTERS.labels(stream=stream).inc()


async def observed(stream: str, group: str, handling: Awaitable[T]) -> T:
    """Await one entry's handling, counting it and timing it per stream and group."""
    start, outcome = time.perf_counter(), "error"
    try:
        result = await handling
        outcome = "ok"
        return result
    finally:
        HANDLED_SECONDS.labels(stream=stream, group=group, outcome=outcome).observe(time.perf_counter() - start)


async def record_start(redis: Any, key: str, service: str) -> int:
    """Count one start of ``service`` in the run's hash ``key`` (``Streams.key(SERVICE_STARTS)``);
    returns its starts so far. The coordinator serves starts - 1 as the service's restarts."""
    return int(await redis.hincrby(key, service, 1))


def exposition(registry: CollectorRegistry = REGISTRY, accept: str | None = None) -> tuple[bytes, str]:
    """The registry in the text format the scraper asked for (Prometheus text or OpenMetrics)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
