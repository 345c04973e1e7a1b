"""No refusal leaves a Tinker training client waiting: the unmodified SDK (tinker 0.38) on a live ``tandem serve``.

The SDK numbers every training request (``seq_id``) and the server runs them in that order. A
request refused when it is submitted still takes its ``seq_id`` (as a failed operation), so the
client's next request runs; an unserved route answers in the SDK's error shape; a ``seq_id``
sent again with a different body is refused as a conflict and the first request stands.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from services.common.embedded_redis import EmbeddedRedis
from tests.helpers import tinker_server, tinker_service
from tests.tinker_server import TinkerServer

KEY = "tml-never-hang"
IDS = [60 + (7 * i) % 50 for i in range(24)]
WAIT_S = 120  # far above a step on the tiny model; the hang this guards against lasted for ever


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    url = redis_server.url.rsplit("/", 1)[0] + "/8"
    with tinker_server(url, tmp_path_factory.mktemp("tinker-hang")) as srv:
        yield srv


@pytest.fixture
def service(server: TinkerServer) -> Iterator[tinker.ServiceClient]:
    with tinker_service(server.url, KEY) as client:
        yield client


def sft_datum(ids: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def step(tc: tinker.TrainingClient) -> float:
    """One SFT step, bounded in time: it fails the test instead of hanging."""
    fb = tc.forward_backward([sft_datum(IDS)], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
    loss = fb.result(timeout=WAIT_S).metrics["loss:sum"]
    opt.result(timeout=WAIT_S)
    return loss


def test_a_request_refused_at_submission_does_not_stall_the_client(service: tinker.ServiceClient,
                                                                    tiny_model_dir: Path):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    first = step(tc)
    with pytest.raises(tinker.BadRequestError, match="beta1"):  # refused by the route: HTTP 400
        tc.optim_step(types.AdamParams(learning_rate=1e-3, beta1=1.5)).result(timeout=WAIT_S)
    image = types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png"),
                                     types.EncodedTextChunk(tokens=IDS[:4])])
    with pytest.raises(tinker.BadRequestError, match="encoded_text"):
        tc.forward_backward([types.Datum(model_input=image, loss_fn_inputs={"target_tokens": IDS[1:6],
                                                                           "weights": [1.0] * 5})],
                            "cross_entropy").result(timeout=WAIT_S)
    assert step(tc) < first  # the later requests run, in order, on the same client


def test_an_unserved_route_answers_in_the_sdk_error_shape_and_frees_its_seq_id(service: tinker.ServiceClient,
                                                                               server: TinkerServer,
                                                                               tiny_model_dir: Path):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=1).result()
    step(tc)

    async def unserved_call() -> object:  # what an SDK method does for a route this server lacks
        turn = tc._get_request_id()
        async with tc._take_turn(turn):
            with tc.holder.aclient(tinker.lib.client_connection_pool_type.ClientConnectionPoolType.TRAIN) as c:
                return await c.post("/api/v1/some_future_op", body={"model_id": tc.model_id, "seq_id": turn + 1},
                                    cast_to=object)

    with pytest.raises(tinker.NotFoundError, match="not served by this Tandem server"):
        tc.holder.run_coroutine_threadsafe(unserved_call()).result(timeout=WAIT_S)
    step(tc)
    r = httpx.get(server.url + "/api/v1/nothing/here", headers={"X-API-Key": KEY})
    assert r.status_code == 404 and r.json()["category"] == "user" and "not served" in r.json()["error"]


def test_a_repeated_seq_id_with_another_body_is_a_conflict(service: tinker.ServiceClient, server: TinkerServer,
                                                          tiny_model_dir: Path):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=2).result()

    def post(body: dict[str, object]) -> httpx.Response:
        return httpx.post(server.url + "/api/v1/optim_step", json=body, headers={"X-API-Key": KEY}, timeout=30)

    body = {"model_id": tc.model_id, "seq_id": 1, "type": "optim_step", "adam_params": {"learning_rate": 1e-3}}
    first = post(body)
    assert first.status_code == 200
    again = post(dict(reversed(list(body.items()))))  # the same request, its keys in another order
    assert again.status_code == 200 and again.json()["request_id"] == first.json()["request_id"]
    other = post({**body, "adam_params": {"learning_rate": 5e-1}})
    # 400, not 409: the SDK retries a 409 for minutes
    assert other.status_code == 400 and "conflict" in other.json()["error"], other.text
    assert other.json()["category"] == "user"
    record = httpx.post(server.url + "/api/v1/retrieve_future", json={"request_id": first.json()["request_id"]},
                        headers={"X-API-Key": KEY}, timeout=60).json()
    assert record["metrics"]["learning_rate:mean"] == pytest.approx(1e-3)  # the first request stands
