"""The embedded Valkey: a generated password, 127.0.0.1 only, its AOF kept across a restart, the fsync
policy it is given, and the parent-death signal (it never outlives the process that started it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from services.common.embedded_redis import EmbeddedRedis

REPO = Path(__file__).resolve().parents[2]


def test_password_loopback_fsync_and_restart_on_the_aof(tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path / "data").start()  # the default fsyncs every write
    try:
        assert server.password and len(server.password) == 32 and server.password in server.url
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).set("x", 1)
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert server.password not in " ".join(server.proc.args)  # config on stdin: not in the process list
        client.xadd("s", {"f": "1"})
        server.proc.kill()
        server.proc.wait()
        assert not server.alive()
        server.restart()
        assert client.xlen("s") == 1  # same port and password (the client reconnects), data from the AOF
    finally:
        server.stop()


def test_a_sigkilled_parent_takes_its_valkey_with_it(tmp_path):
    code = ("import sys, time; from services.common.embedded_redis import EmbeddedRedis; "
            f"s = EmbeddedRedis(data_dir={str(tmp_path)!r}).start(); print(s.proc.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pid = int(parent.stdout.readline())
        assert Path(f"/proc/{pid}").exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.time() + 10
        while time.time() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists(), "Valkey outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()
