"""``tandem serve`` cleans up after its clients: idle sessions expire, unused ephemeral snapshots are collected.

A live server with short lifetimes (sessions 12 s without a heartbeat — the SDK beats every
10 s —, ephemeral snapshots 2 s unused, a sweep every 0.5 s). Named checkpoints always stay.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from services.common.embedded_redis import EmbeddedRedis
from tests.helpers import tinker_service
from tests.tinker_server import TinkerServer

KEY = "tml-lifetimes"
IDS = [60 + (7 * i) % 50 for i in range(24)]
SESSION_IDLE_S = 12.0
SETTINGS = {"session_idle_s": SESSION_IDLE_S, "sampler_idle_s": 2.0, "reap_every_s": 0.5}


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    url = redis_server.url.rsplit("/", 1)[0] + "/10"
    srv = TinkerServer(url, tmp_path_factory.mktemp("tinker-life"), settings=SETTINGS).start()
    try:
        yield srv
    finally:
        srv.stop()


def post(server: TinkerServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"X-API-Key": KEY}, timeout=60)


def finished(server: TinkerServer, rid: str) -> dict[str, object]:
    for _ in range(100):
        out = post(server, "/api/v1/retrieve_future", {"request_id": rid}).json()
        if out.get("type") != "try_again":
            return out
    raise AssertionError(f"no result for {rid}")


def raw_client(server: TinkerServer, base_model: Path) -> tuple[str, str]:
    """A session and a model made over plain HTTP (so the test decides when heartbeats are sent); the model
    saves one ephemeral snapshot and one named one."""
    sid = post(server, "/api/v1/create_session", {"tags": [], "sdk_version": "test"}).json()["session_id"]
    made = post(server, "/api/v1/create_model", {"session_id": sid, "model_seq_id": 0, "base_model": str(base_model),
                                                 "lora_config": {"rank": 2, "seed": 0}}).json()
    finished(server, made["request_id"])
    model_id = made["model_id"]
    for seq, extra in ((1, {"sampling_session_seq_id": 0}), (2, {"path": "named"})):
        rid = post(server, "/api/v1/save_weights_for_sampler", {"model_id": model_id, "seq_id": seq, **extra}).json()
        assert "path" in finished(server, rid["request_id"])
    return sid, model_id


def test_a_session_without_heartbeats_expires_and_its_snapshots_go(server: TinkerServer, tiny_model_dir: Path):
    alive, alive_model = raw_client(server, tiny_model_dir)
    idle, idle_model = raw_client(server, tiny_model_dir)
    snaps = server.data_dir / "runs"
    assert (snaps / idle_model / "sampler_weights" / "ephemeral-1").is_dir()
    loaded = httpx.get(server.url + "/health").json()["models_loaded"]
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(1.0):
            post(server, "/api/v1/session_heartbeat", {"session_id": alive})

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        deadline = time.monotonic() + SESSION_IDLE_S + 20
        while (snaps / idle_model / "sampler_weights" / "ephemeral-1").exists():  # (a heartbeat would revive it)
            assert time.monotonic() < deadline, "the idle session never expired"
            time.sleep(0.5)
    finally:
        stop.set()
        beater.join()
    assert post(server, "/api/v1/session_heartbeat", {"session_id": idle}).status_code == 410
    assert (snaps / idle_model / "sampler_weights" / "named").is_dir()  # named saves are kept
    assert (snaps / alive_model / "sampler_weights" / "ephemeral-1").is_dir()
    assert post(server, "/api/v1/session_heartbeat", {"session_id": alive}).status_code == 200
    assert httpx.get(server.url + "/health").json()["models_loaded"] == loaded - 1


def test_unused_ephemeral_snapshots_are_collected_the_newest_kept(server: TinkerServer, tiny_model_dir: Path):
    with tinker_service(server.url, KEY) as service:
        tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=2, seed=1).result()
        prompt, params = types.ModelInput.from_ints(IDS[:6]), types.SamplingParams(max_tokens=2, stop=[])
        old = tc.save_weights_and_get_sampling_client().result()
        old.sample(prompt, 1, params).result()
        tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(IDS[:-1]),
                                         loss_fn_inputs={"target_tokens": IDS[1:], "weights": [1.0] * 23})],
                           "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        new = tc.save_weights_and_get_sampling_client().result()
        kept = tc.save_weights_for_sampler("kept").result().path
        dirs = server.data_dir / "runs" / tc.model_id / "sampler_weights"
        ephemeral = sorted(d.name for d in dirs.glob("ephemeral-*"))
        assert len(ephemeral) == 2, ephemeral
        deadline = time.monotonic() + 30
        while (dirs / ephemeral[0]).exists():
            assert time.monotonic() < deadline, "the unused snapshot was never collected"
            time.sleep(0.5)
        assert (dirs / ephemeral[1]).is_dir() and (dirs / "kept").is_dir()
        new.sample(prompt, 1, params).result()  # the newest still samples
        with pytest.raises(tinker.RequestFailedError, match="gone"):
            old.sample(prompt, 1, params).result()
        assert service.create_sampling_client(model_path=kept).result().sample(prompt, 1, params).result()
