"""The Tinker API service is durable and ordered: bit-exact save/load, seq_id order, idempotent retries,
futures that survive a restart (SIGKILL) of the service, API keys. The SDK is the unmodified official one;
the repeated and out-of-order requests are sent as the SDK encodes them (its own protobuf writer)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from services.common.embedded_redis import EmbeddedRedis
from tests.helpers import tinker_server, tinker_service
from tests.integration.test_tinker_api import IDS, KEY, forward_logprobs, sft_datum, train_steps
from tests.tinker_server import TinkerServer


def db_url(server: EmbeddedRedis, db: int) -> str:
    return server.url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    with tinker_server(db_url(redis_server, 4), tmp_path_factory.mktemp("tinker")) as srv:
        yield srv


@pytest.fixture
def service(server: TinkerServer) -> Iterator[tinker.ServiceClient]:
    with tinker_service(server.url, KEY) as client:
        yield client


def test_save_state_and_load_are_bit_exact(service: tinker.ServiceClient, tiny_model_dir: Path):
    a = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=6).result()
    train_steps(a, 2)
    at_save = forward_logprobs(a, IDS)
    ckpt = a.save_state("ck").result().path
    assert ckpt.startswith("tinker://") and "/weights/ck" in ckpt
    train_steps(a, 1)
    after = forward_logprobs(a, IDS)
    # with the optimizer: the next step is the one the original took, bit for bit
    b = service.create_training_client_from_state_with_optimizer(ckpt).result()
    assert np.array_equal(forward_logprobs(b, IDS), at_save)
    train_steps(b, 1)
    assert np.array_equal(forward_logprobs(b, IDS), after)
    # weights only: the same weights, a fresh optimizer (so the next step differs)
    c = service.create_training_client_from_state(ckpt).result()
    assert np.array_equal(forward_logprobs(c, IDS), at_save)
    train_steps(c, 1)
    assert not np.array_equal(forward_logprobs(c, IDS), after)


def _post(url: str, path: str, headers: dict[str, str] | None = None, **kw: object) -> dict:
    r = httpx.post(url + path, headers={"X-API-Key": KEY, **(headers or {})}, timeout=60, **kw)  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    return r.json()


def _fb_body(model_id: str, seq: int, forward_only: bool = False) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[sft_datum(IDS)], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def _result(url: str, rid: str) -> httpx.Response:
    for _ in range(60):
        r = httpx.post(url + "/api/v1/retrieve_future", json={"request_id": rid}, timeout=60,
                       headers={"X-API-Key": KEY, "Accept": "application/x-protobuf"})
        if "protobuf" in r.headers.get("content-type", "") or r.json().get("type") != "try_again":
            return r
    raise AssertionError(f"no result for {rid}")


def test_seq_order_and_repeated_seq_ids(service: tinker.ServiceClient, server: TinkerServer, tiny_model_dir: Path):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=7).result()
    twin = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=7).result()
    train_steps(twin, 1)
    fb = {"content": _fb_body(tc.model_id, 1), "headers": {"Content-Type": "application/x-protobuf"}}
    opt = {"json": {"model_id": tc.model_id, "seq_id": 2, "type": "optim_step",
                    "adam_params": {"learning_rate": 1e-2}}}
    # the optimizer step arrives first: it waits for forward_backward (seq 1); both are sent twice
    opt_ids = {_post(server.url, "/api/v1/optim_step", **opt)["request_id"]}
    fb_ids = {_post(server.url, "/api/v1/forward_backward", **fb)["request_id"] for _ in range(2)}
    opt_ids.add(_post(server.url, "/api/v1/optim_step", **opt)["request_id"])
    assert len(fb_ids) == 1 and len(opt_ids) == 1
    out = deserialize_forward_backward_output(_result(server.url, fb_ids.pop()).content)
    assert out.metrics["loss:sum"] > 0
    assert "grad_norm:mean" in _result(server.url, opt_ids.pop()).json()["metrics"]
    fwd = _post(server.url, "/api/v1/forward_backward", content=_fb_body(tc.model_id, 3, forward_only=True),
                headers={"Content-Type": "application/x-protobuf"})
    got = deserialize_forward_backward_output(_result(server.url, fwd["request_id"]).content)
    assert np.array_equal(got.loss_fn_outputs[0]["logprobs"].to_numpy(), forward_logprobs(twin, IDS))


def test_api_keys(redis_server: EmbeddedRedis, tmp_path: Path, tiny_model_dir: Path):
    srv = TinkerServer(db_url(redis_server, 6), tmp_path, api_keys=["tml-right"]).start()
    try:
        assert httpx.get(srv.url + "/api/v1/healthz").status_code == 200
        r = httpx.post(srv.url + "/api/v1/create_session", json={"tags": [], "sdk_version": "x"},
                       headers={"X-API-Key": "tml-wrong"})
        assert r.status_code == 401 and r.json()["category"] == "user"
        with pytest.raises(tinker.AuthenticationError):
            tinker.ServiceClient(base_url=srv.url, api_key="tml-wrong").create_lora_training_client(
                base_model="x", rank=1).result()
        client = tinker.ServiceClient(base_url=srv.url, api_key="tml-right")
        sampler = client.create_sampling_client(base_model=str(tiny_model_dir)).result()
        assert sampler.compute_logprobs(types.ModelInput.from_ints(IDS[:4])).result()[0] is None
        client.close("success").result()
    finally:
        srv.stop()


def test_a_future_survives_a_restart(redis_server: EmbeddedRedis, tmp_path: Path, tiny_model_dir: Path):
    url = db_url(redis_server, 5)
    srv = TinkerServer(url, tmp_path).start()
    client = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
    try:
        tc = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=8).result()
        twin = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=8).result()
        train_steps(tc, 1)
        fb = tc.forward_backward([sft_datum(IDS)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        r = redis.Redis.from_url(url)
        for _ in range(200):  # both are recorded (answered with a request_id) before the kill
            if r.hexists(f"tk:ops:{tc.model_id}", "3"):
                break
            time.sleep(0.05)
        srv.kill()
        srv = TinkerServer(url, tmp_path, port=srv.port).start()
        assert fb.result().metrics["loss:sum"] > 0  # the SDK's poll reaches the new process
        opt.result()
        train_steps(tc, 1)  # the model was rebuilt from its log and goes on
        train_steps(twin, 3)
        assert np.array_equal(forward_logprobs(tc, IDS), forward_logprobs(twin, IDS))
    finally:
        client.close("success").result()
        srv.stop()


def test_bad_http_requests_get_the_sdk_error_shape_never_a_500(server: TinkerServer):
    def post(path: str, headers: dict[str, str] | None = None, **kw: object) -> httpx.Response:
        return httpx.post(server.url + path, headers={"X-API-Key": KEY, **(headers or {})}, timeout=30,
                          **kw)  # type: ignore[arg-type]

    cases = [
        post("/api/v1/forward_backward", content=b"\x08\xff\xff not a protobuf",
             headers={"Content-Type": "application/x-protobuf"}),
        post("/api/v1/optim_step", json={"model_id": "nobody:train:0", "seq_id": 1}),
        post("/api/v1/optim_step", json={"model_id": "x", "seq_id": 0}),
        post("/api/v1/optim_step", content=b"{not json"),
        post("/api/v1/create_model", json={"session_id": "nope", "model_seq_id": 0, "base_model": "m"}),
        post("/api/v1/create_sampling_session", json={"session_id": "nope", "sampling_session_seq_id": 0}),
        post("/api/v1/asample", json={"sampling_session_id": "nope", "seq_id": 0, "prompt": {"chunks": []},
                                      "sampling_params": {}}),
        post("/api/v1/retrieve_future", json={"request_id": "nope#1"}),
        post("/api/v1/session_heartbeat", json={"session_id": "nope"}),
    ]
    for r in cases:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        body = r.json()
        assert body["category"] == "user" and body["error"], body
    assert "seq_id" in cases[2].json()["error"] and "unknown model" in cases[1].json()["error"]
