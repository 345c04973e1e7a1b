"""The demo model: a tiny Qwen3-architecture LM with a byte-level tokenizer, made offline."""
