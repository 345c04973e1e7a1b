"""Render an agent's view with that agent's tokenizer and chat template, token-exact across turns.

A view grows turn by turn and is never re-encoded: the agent's generated ids
stay exactly as the engine returned them. Before each new user message the
renderer works out, from the chat template itself, the text that template puts
*between* the previous generation prompt and the new one: the end of the
assistant turn (what the template writes after an assistant message's
content, found by rendering an empty one; skipped when the engine already
produced the end-of-turn token) and the new user message with the
generation prompt. Templates that trim or reformat the content still work:
the content itself is never taken from the template. Only that delta is
tokenised and appended. This is exact for any template that renders a
conversation as a prefix of its continuation (ChatML, Llama-3, the demo
template, ...). A template that is not prefix-stable (one that rewrites
earlier turns, e.g. dropping past reasoning) falls back to rendering each user
turn on its own after an end-of-turn token, and says so once in the log.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("tandem.render")
Messages = tuple[tuple[str, str], ...]


@functools.lru_cache(maxsize=65536)
def _render_str(tokenizer: Any, messages: Messages, generation_prompt: bool) -> str:
    out = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                        add_generation_prompt=generation_prompt, tokenize=False)
    return str(out)


@functools.lru_cache(maxsize=65536)
def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


_warned: set[int] = set()


class ChatRenderer:
    """One role's conversation as the agent's chat template renders it."""

    def __init__(self, tokenizer: Any, system: str | None = None) -> None:
        self.tok = tokenizer
        self.messages: list[tuple[str, str]] = [("system", system)] if system else []
        self.prompt = ""  # the rendered conversation up to the last generation prompt
        self.last_reply: tuple[str, bool] | None = None  # (text, ended with eos) of the last reply
        self.exact = True

    def user_turn(self, text: str, role: str = "user") -> list[int]:
        """Tokens to append before the next generation: the end of the previous assistant
        turn (if any) and ``text`` as a ``role`` message (a user's, or a tool result's: "tool")
        with the generation prompt."""
        closer: list[int] = []
        before = self.prompt
        if self.last_reply is not None:
            reply, ended = self.last_reply
            empty = _render_str(self.tok, tuple(self.messages) + (("assistant", ""),), False)
            self.messages.append(("assistant", reply))
            done = _render_str(self.tok, tuple(self.messages), False)
            end = empty[len(before):]  # what the template writes after an assistant message's content
            if self.exact and done.startswith(before) and empty.startswith(before) and done.endswith(end):
                closer = list(_encode(self.tok, end))
                eos = self.tok.eos_token_id
                if ended and closer and closer[0] == eos:
                    closer = closer[1:]
                before = done
            else:
                self._fallback("the rendered assistant turn does not extend the prompt")
                closer = [] if ended else [self.tok.eos_token_id]
            self.last_reply = None
        self.messages.append((role, text))
        prompt = _render_str(self.tok, tuple(self.messages), True)
        if self.exact and prompt.startswith(before):
            delta = list(_encode(self.tok, prompt[len(before):]))
        else:
            self._fallback("the rendered prompt does not extend the previous turns")
            system = [m for m in self.messages if m[0] == "system"][:1]
            delta = list(_encode(self.tok, _render_str(self.tok, tuple(system + [(role, text)]), True)))
        self.prompt = prompt
        return closer + delta

    def assistant_turn(self, output_ids: list[int]) -> str:
        """Record the engine's reply; return its text (special tokens dropped)."""
        text = self.tok.decode(output_ids, skip_special_tokens=True)
        self.last_reply = (text, bool(output_ids) and output_ids[-1] == self.tok.eos_token_id)
        return text

    def conversation(self) -> list[dict[str, str]]:
        """The chat so far as messages (role, content), the last reply included: what the view renders."""
        pending = [("assistant", self.last_reply[0])] if self.last_reply is not None else []
        return [{"role": r, "content": c} for r, c in self.messages + pending]

    def _fallback(self, why: str) -> None:
        if self.exact and id(self.tok) not in _warned:
            _warned.add(id(self.tok))
            log.warning("chat template of %s is not prefix-stable (%s): rendering each user turn on its own",
                        getattr(self.tok, "name_or_path", "tokenizer"), why)
        self.exact = False


def render_user_turn(tokenizer: Any, text: str, system: str | None = None) -> list[int]:
    """Chat-template tokens of one user message plus the generation prompt (a first turn)."""
    return ChatRenderer(tokenizer, system).user_turn(text)
