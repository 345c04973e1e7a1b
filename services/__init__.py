"""Tandem: two (or more) LLM agents co-trained by RL over Redis Streams."""
