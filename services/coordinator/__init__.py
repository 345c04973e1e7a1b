"""Coordinator: runs episodes between agents, computes rewards, emits samples, serves the control API."""
