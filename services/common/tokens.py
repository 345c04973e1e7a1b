"""Token ids and logprobs against an agent's model: the vocabulary size (read once from the model's
``config.json``) and the checks the buffer (samples) and the rollout (engine replies) make at their
boundaries. The wire contract already holds ids ≥ 0 and logprobs finite and ≤ 0; the upper bound
of an id is the model's, so it is checked here.

Also the model's tokenizer and context window for processes that run no model (the coordinator,
docs/architecture.md §1, §3): ``load_tokenizer`` and ``context_length`` give what ``AutoTokenizer`` and
``AutoConfig`` give, without importing torch (``transformers.AutoTokenizer`` and ``AutoConfig`` do, via
its configuration module) for the tokenizers this project's models use; anything else falls back to
them (correct, only slower to import)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from services.common.adapter_dir import base_of

log = logging.getLogger("tandem.tokens")


# (config.json model_type, tokenizer_config.json tokenizer_class) -> the class AutoTokenizer picks for them
# (transformers 5: the model type's registered class unless the hub names another transformers class)
_TORCH_FREE = {
    **{(m, c): "TokenizersBackend" for m in ("qwen3", "qwen3_moe")
       for c in ("TokenizersBackend", "PreTrainedTokenizerFast")},
    **{(m, c): "Qwen2Tokenizer" for m in ("qwen3", "qwen3_moe") for c in ("Qwen2Tokenizer", "Qwen2TokenizerFast")},
}


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@lru_cache(maxsize=64)
def load_tokenizer(model_path: str) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(model_path)`` loads, without importing torch when
    the directory holds a ``tokenizer.json`` of a known kind (``_TORCH_FREE``); else AutoTokenizer's."""
    model_path = base_of(model_path)  # an adapter directory: its base's tokenizer
    root = Path(model_path)
    tok_cfg, model_type = _json(root / "tokenizer_config.json"), _json(root / "config.json").get("model_type")
    name = _TORCH_FREE.get((model_type, tok_cfg.get("tokenizer_class")))
    if name is not None and "auto_map" not in tok_cfg and (root / "tokenizer.json").is_file():
        import transformers  # the package itself, and its tokenizer classes, import no torch

        return getattr(transformers, name).from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@lru_cache(maxsize=64)
def context_length(model_path: str) -> int:
    """A model's context window (a prompt that reaches it ends the episode as truncated): its config's
    ``max_position_embeddings`` as ``AutoConfig`` reads it; read from config.json, without torch, when
    it is written there."""
    model_path = base_of(model_path)  # an adapter directory: its base's window
    size = _json(Path(model_path) / "config.json").get("max_position_embeddings")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    return int(getattr(cfg, "max_position_embeddings", None) or 1 << 62)


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
