"""The bus's exceptions: what a handler raises to steer delivery, and a full Redis.

``Reject`` and ``RetryLater`` are raised by consume handlers (delivery rules: services/common/bus/core.py);
``RedisFull`` is raised by the bus when Redis refuses writes at its ``maxmemory`` (docs/architecture.md §10).
"""

from __future__ import annotations

from redis.exceptions import OutOfMemoryError, ResponseError


class RetryLater(Exception):
    """Raised by a handler to leave the entry pending; it is reclaimed later (not counted as a failure)."""


class Reject(Exception):
    """Raised by a handler when the message itself is unusable: it is dead-lettered at once with the reason."""


class RedisFull(RuntimeError):
    """Redis refused a write because its ``maxmemory`` is reached (policy noeviction): the run cannot go on."""


def full_error(exc: ResponseError) -> RedisFull | None:
    """The clear error for Redis's OOM refusal, or None when ``exc`` is another error."""
    if not isinstance(exc, OutOfMemoryError) and not str(exc).startswith("OOM"):
        return None
    return RedisFull(f"Redis is full: its maxmemory is reached and it refuses writes ({exc}). Raise "
                     "run.redis_maxmemory_mb (embedded Redis) or the server's maxmemory, or keep fewer "
                     "transcripts (run.transcripts_kept)")
