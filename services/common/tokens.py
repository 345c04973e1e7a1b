"""Token ids and logprobs against an agent's model: the vocabulary size (read once from the model's
``config.json``) and the checks the buffer (samples) and the rollout (engine replies) make at their
boundaries. The wire contract already holds ids ≥ 0 and logprobs finite and ≤ 0; the upper bound
of an id is the model's, so it is checked here."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("tandem.tokens")


def vocab_size(model_path: str) -> int | None:
    """The model's vocabulary size (its embedding rows: ``vocab_size`` in ``config.json``, or its text
    config's); None, with a warning, when the model directory has no readable config.json."""
    path = Path(model_path) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("cannot read the vocabulary size from %s (%s): token ids are checked only for being >= 0",
                    path, exc)
        return None
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size <= 0:
        log.warning("%s has no positive vocab_size: token ids are checked only for being >= 0", path)
        return None
    return size


def ids_problem(ids: Sequence[int], vocab: int | None, field: str) -> str | None:
    """Why ``ids`` are not token ids of a ``vocab``-sized vocabulary (the first bad one), or None."""
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab is not None and t >= vocab):
            bound = f"[0, {vocab})" if vocab is not None else ">= 0"
            return f"{field}[{i}] = {t!r} is not a token id of the agent's vocabulary ({bound})"
    return None


def logprobs_problem(logprobs: Sequence[float], field: str) -> str | None:
    """Why ``logprobs`` are not log-probabilities (the first non-finite or positive one), or None."""
    for i, x in enumerate(logprobs):
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x > 0:
            return f"{field}[{i}] = {x!r} is not a log-probability (finite, <= 0)"
    return None
