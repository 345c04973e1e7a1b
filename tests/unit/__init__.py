"""In-process tests: no Redis, engine, router, HTTP server or child process (``make test-unit``)."""
