"""Tests that start a real Redis, engine, router, HTTP server or child process."""
