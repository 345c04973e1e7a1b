"""Trainer service: trains one agent's policy on batches and publishes new weights."""
