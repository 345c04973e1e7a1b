"""Create a tiny Qwen3-architecture causal LM and a byte-level tokenizer from a config.

Nothing is downloaded: the tokenizer is byte-level BPE with no merges (every
byte is a token) plus a few special tokens and a minimal chat template; the
model's weights are initialised from a seed. ``warmstart.py`` then trains it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what ByteLevel expects)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(tokenizer: PreTrainedTokenizerFast, hidden: int = 128, layers: int = 2) -> Qwen3Config:
    vocab = (len(tokenizer) + 7) // 8 * 8
    return Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, max_position_embeddings=1024, tie_word_embeddings=True,
        rope_theta=10000.0, rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, torch_dtype="float32",
    )


def create_tiny_model(path: str | Path, seed: int = 0, hidden: int = 128,
                      layers: int = 2) -> Path:
    """Write a freshly initialised tiny model + tokenizer as an HF directory."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(build_config(tokenizer, hidden, layers))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
