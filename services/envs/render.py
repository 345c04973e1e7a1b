"""Render an agent's view with that agent's tokenizer and chat template.

A view grows turn by turn: each new user message is rendered on its own (with
the generation prompt) and appended; the agent's generated tokens are
appended exactly as the engine returned them, never re-encoded.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=65536)
def _render(tokenizer: Any, text: str, system: str | None) -> tuple[int, ...]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return tuple(int(t) for t in out)


def render_user_turn(tokenizer: Any, text: str, system: str | None = None) -> list[int]:
    """Chat-template tokens of one user message plus the generation prompt (memoised:
    the template is a pure function of tokenizer and text, and rendering is costly)."""
    return list(_render(tokenizer, text, system))


def close_assistant_turn(tokenizer: Any, output_ids: list[int]) -> list[int]:
    """Tokens (loss-masked out) that end an assistant turn the engine cut short."""
    eos = tokenizer.eos_token_id
    if output_ids and output_ids[-1] == eos:
        return []
    return [eos]
