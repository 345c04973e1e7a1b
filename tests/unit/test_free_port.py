"""``free_port`` draws below the kernel's ephemeral range, so outgoing connections cannot take its ports."""

from __future__ import annotations

import socket

import pytest

from services.common import embedded_redis
from services.common.embedded_redis import _ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert all(1024 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random, not handed out in order
    for port in list(ports)[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    low = max(1024, _ephemeral_low() - embedded_redis.PORTS_BELOW_EPHEMERAL)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        neighbour = taken + 1 if taken + 1 < _ephemeral_low() else taken - 1
        draws = iter([taken - low, neighbour - low])  # the port in use first, then its neighbour
        monkeypatch.setattr(embedded_redis.secrets, "randbelow", lambda n: next(draws))
        assert free_port() == neighbour
