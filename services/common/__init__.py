"""Shared runtime pieces (bus, embedded Redis, service plumbing); imports no service."""
