"""Token-exact multi-turn rendering through HF chat templates (tokenizers built here, no download)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from services.demo.tiny_model import build_tokenizer
from services.envs.render import ChatRenderer, render_user_turn

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# not prefix-stable: the first line counts the messages, so every render rewrites the start
COUNTING = ("[{{ messages | length }} messages]\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer(specials: list[str], eos: str, template: str, bos: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with a few merges (so text is not one token per byte)."""
    merges = [("i", "s"), ("t", "h"), ("th", "e"), ("Ġ", "is")]
    symbols = [chr(i) for i in range(33, 127)] + ["Ġ", "Ċ"] + [a + b for a, b in merges]
    vocab = {sym: i for i, sym in enumerate(symbols)}  # contiguous ids: the special tokens follow
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos,
                                   additional_special_tokens=[s for s in specials if s not in (eos, bos)])
    fast.chat_template = template
    return fast


@pytest.fixture(params=["chatml", "llama3"])
def tokenizer(request) -> PreTrainedTokenizerFast:
    if request.param == "chatml":
        return byte_tokenizer(["<|im_start|>", "<|im_end|>"], "<|im_end|>", CHATML)
    return byte_tokenizer(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                          "<|eot_id|>", LLAMA3, bos="<|begin_of_text|>")


def full_render(tok, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("system", [None, "Play well."])
def test_view_equals_the_template_render_of_the_whole_conversation(tokenizer, system: str | None) -> None:
    renderer = ChatRenderer(tokenizer, system)
    view: list[int] = []
    messages = [{"role": "system", "content": system}] if system else []
    replies = [("the move is 5", True), ("this is it", False), ("Ok then", True)]  # the 2nd was cut short
    for i, (reply, ends_with_eos) in enumerate(replies):
        user = f"board {i}: x..o"
        view += renderer.user_turn(user)
        messages.append({"role": "user", "content": user})
        assert view == full_render(tokenizer, messages, True), f"turn {i}"
        output = tokenizer.encode(reply, add_special_tokens=False) + (
            [tokenizer.eos_token_id] if ends_with_eos else [])
        assert renderer.assistant_turn(output) == reply
        view += output  # the engine's ids, never re-encoded
        messages.append({"role": "assistant", "content": reply})
    assert renderer.exact
    view += renderer.user_turn("final")
    messages.append({"role": "user", "content": "final"})
    assert view == full_render(tokenizer, messages, True)
    assert view.count(tokenizer.eos_token_id) == len(messages)  # one end-of-turn per message, none doubled


def test_generated_ids_are_kept_even_when_they_tokenise_differently(tokenizer) -> None:
    renderer = ChatRenderer(tokenizer)
    view = renderer.user_turn("hi")
    n = len(view)
    merged = tokenizer.encode("this", add_special_tokens=False)
    unmerged = [tokenizer.convert_tokens_to_ids(c) for c in "this"]  # the same text, other ids
    assert merged != unmerged and tokenizer.decode(unmerged) == "this"
    renderer.assistant_turn(unmerged + [tokenizer.eos_token_id])
    view += unmerged + [tokenizer.eos_token_id]
    view += renderer.user_turn("next")
    full = full_render(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "this"},
                                   {"role": "user", "content": "next"}], True)
    assert full[n:n + len(merged)] == merged
    assert view == full[:n] + unmerged + full[n + len(merged):]


def test_a_template_that_trims_content_stays_exact() -> None:
    tok = byte_tokenizer(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                         "<|eot_id|>", LLAMA3, bos="<|begin_of_text|>")
    renderer = ChatRenderer(tok)
    view = renderer.user_turn("go")
    out = tok.encode(" 5 \n", add_special_tokens=False) + [tok.eos_token_id]  # the template would trim it
    renderer.assistant_turn(out)
    view += out
    view += renderer.user_turn("next")
    assert renderer.exact
    expected = full_render(tok, [{"role": "user", "content": "go"}, {"role": "assistant", "content": "5"},
                                 {"role": "user", "content": "next"}], True)
    five = tok.encode("5", add_special_tokens=False)
    i = expected.index(five[0])
    assert view == expected[:i] + out[:-1] + expected[i + len(five):]


def test_a_template_that_is_not_prefix_stable_falls_back_per_turn(caplog) -> None:
    tok = byte_tokenizer(["<|im_start|>", "<|im_end|>"], "<|im_end|>", COUNTING)
    renderer = ChatRenderer(tok)
    first = renderer.user_turn("a")
    assert first == full_render(tok, [{"role": "user", "content": "a"}], True)
    renderer.assistant_turn(tok.encode("b", add_special_tokens=False))  # cut short: no end-of-turn
    with caplog.at_level("WARNING"):
        second = renderer.user_turn("c")
    assert not renderer.exact and "not prefix-stable" in caplog.text
    assert second == [tok.eos_token_id] + full_render(tok, [{"role": "user", "content": "c"}], True)


def close_assistant_turn(tokenizer, output_ids: list[int]) -> list[int]:
    """The end-of-turn token after an assistant turn the engine cut short (demo-style templates)."""
    return [] if output_ids and output_ids[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id]


def test_demo_template_renders_as_before() -> None:
    """The demo model was warm-started on per-turn renders; the renderer gives exactly those."""
    tok = build_tokenizer()
    renderer = ChatRenderer(tok)
    old: list[int] = []
    new: list[int] = []
    for obs, out in [("....x....|o", tok.encode("3", add_special_tokens=False)),
                     ("..ox.x...|o", tok.encode("7", add_special_tokens=False) + [tok.eos_token_id])]:
        if old:
            old += close_assistant_turn(tok, old)
        old += render_user_turn(tok, obs) + out
        new += renderer.user_turn(obs) + out
        renderer.assistant_turn(out)
    old += close_assistant_turn(tok, old) + render_user_turn(tok, "xx.ox.o..|o")
    new += renderer.user_turn("xx.ox.o..|o")
    assert new == old
