"""One generation request of the embedded engine, its completion handle and its errors.

A ``GenRequest`` is one sample: its prompt, its sampling parameters and, once the engine's worker
thread has finished it, its output tokens, logprobs, finish reason and weight-version history.
``Completion`` resolves an asyncio future of the caller's loop from the worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch


class EngineError(ValueError):
    """A request the engine cannot serve as given (the HTTP layer answers 400)."""


class Completion:
    """An asyncio future of the caller's loop, resolved from the worker thread."""

    __slots__ = ("future", "loop")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] = self.loop.create_future()

    def _set(self, value: Any, exc: BaseException | None) -> None:
        if not self.future.done():  # done: the caller went away (cancelled)
            self.future.set_exception(exc) if exc is not None else self.future.set_result(value)

    def resolve(self, value: Any = None, exc: BaseException | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(self._set, value, exc)


@dataclass(eq=False)
class GenRequest:
    """One generation request (one sample) and, once done, its result."""

    rid: str
    input_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    lora: str | None = None  # the loaded adapter it is generated under (SGLang's lora_path); None: the base
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    weight_version: int = -1  # the version of the last token (SGLang's meta_info.weight_version)
    version_events: list[tuple[int, int]] = field(default_factory=list)  # (old version, tokens made on it)
    aborted: bool = False
    queued_at: float = field(default_factory=time.monotonic)
    done: Completion | None = field(default=None, repr=False)
    gen: torch.Generator | None = field(default=None, repr=False)

    def weight_version_spans(self) -> list[dict[str, Any]]:
        """SGLang's ``meta_info.weight_versions``: which version produced which output tokens."""
        n = len(self.output_ids)
        spans: list[dict[str, Any]] = []
        for version, end in [*self.version_events, (self.weight_version, n)]:
            end = min(end, n)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and spans[-1]["version"] == str(version):
                spans[-1]["end"] = end
                continue
            spans.append({"version": str(version), "start": spans[-1]["end"] if spans else 0, "end": end})
        return spans

    def abort(self, message: str | None = None) -> None:
        """Finish as aborted (a finish reason already set is kept)."""
        self.finish = self.finish or {"type": "abort", "message": message or f"request {self.rid} aborted",
                                      "status_code": None, "err_type": None}

    def resolve(self) -> None:
        if self.done is not None:
            self.done.resolve(self)



def resolve_all(reqs: list[GenRequest]) -> None:
    """Hand finished requests to their callers: one wake-up per event loop, not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[GenRequest]] = {}
    for r in reqs:
        if r.done is not None:
            by_loop.setdefault(r.done.loop, []).append(r)
    for loop, mine in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_set_all, mine)


def _set_all(reqs: list[GenRequest]) -> None:
    for r in reqs:
        if r.done is not None:
            r.done._set(r, None)
