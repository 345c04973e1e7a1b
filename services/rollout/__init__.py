"""Rollout service: generation requests to the agent's SGLang router; weight updates to its engines."""
