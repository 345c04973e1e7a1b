"""Server-side custom losses (``ServiceClient.create_custom_loss``) against the unmodified tinker 0.38 SDK.

The server tells the SDK it runs custom losses (``custom_loss_server_side``), so the SDK uploads
the traced graph and ``forward_backward_custom`` sends one ``forward_backward`` naming its
``loss_id``. The loss's value, metrics and gradient are checked against a hand computation and
against the built-in loss it equals; a graph outside the allowed op set is refused with a 400 in
the SDK's error shape, and the session goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from services.common.embedded_redis import EmbeddedRedis
from tests.helpers import tinker_server, tinker_service
from tests.tinker_server import TinkerServer

KEY = "tml-tandem-custom-loss"
IDS = [60 + (7 * i) % 50 for i in range(24)]


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    url = redis_server.url.rsplit("/", 1)[0] + "/13"  # a database of its own: the suite's flushes never hit it
    with tinker_server(url, tmp_path_factory.mktemp("tinker-custom")) as srv:
        yield srv


@pytest.fixture
def service(server: TinkerServer) -> Iterator[tinker.ServiceClient]:
    with tinker_service(server.url, KEY) as client:
        yield client


def clipped_is(logprobs, old, adv):
    """Importance sampling with a clipped ratio, and two metrics (one summed, one averaged)."""
    ratio = torch.exp(logprobs - old)
    loss = -(torch.clamp(ratio, 0.5, 2.0) * adv).sum() + 0.5 * (logprobs ** 2).mean() * logprobs.shape[0]
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/positive:sum": (adv > 0).float().sum()}


def plain_is(logprobs, old, adv):
    loss = -(torch.exp(logprobs - old) * adv).sum()
    return loss, {"custom/loss:sum": loss}


def rl_datum(ids: list[int], old: np.ndarray, adv: np.ndarray) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "old": old, "adv": adv})


def forward_logprobs(tc: tinker.TrainingClient, ids: list[int]) -> np.ndarray:
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_a_custom_loss_runs_on_the_server_as_computed_by_hand(service: tinker.ServiceClient, tiny_model_dir: Path):
    ranks = {"logprobs": 1, "old": 1, "adv": 1}
    handle = service.create_custom_loss(clipped_is, ranks).result()
    assert handle.loss_id is not None  # uploaded: it runs on the server
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=30).result()
    rng = np.random.default_rng(1)
    data, hand, ratios, positives = [], 0.0, [], 0.0
    for ids in (IDS, IDS[3:17]):
        lp = forward_logprobs(tc, ids)
        old = (lp + rng.uniform(-1.0, 1.0, lp.shape)).astype(np.float32)  # ratios inside and outside the clip
        adv = rng.normal(0, 1, lp.shape).astype(np.float32)
        data.append(rl_datum(ids, old, adv))
        ratio = np.exp(lp - old)
        hand += float(-(np.clip(ratio, 0.5, 2.0) * adv).sum() + 0.5 * (lp ** 2).mean() * lp.size)
        ratios.append(ratio.mean())
        positives += float((adv > 0).sum())
    out = tc.forward_backward_custom(data, handle).result()
    assert out.metrics["loss:sum"] == pytest.approx(hand, rel=1e-4)
    assert out.metrics["custom/ratio:mean"] == pytest.approx(float(np.mean(ratios)), rel=1e-4)
    assert out.metrics["custom/positive:sum"] == positives
    np.testing.assert_allclose(out.loss_fn_outputs[1]["logprobs"].to_numpy(), forward_logprobs(tc, IDS[3:17]),
                               atol=1e-6)


def test_its_gradient_equals_the_builtin_loss_it_matches(service: tinker.ServiceClient, tiny_model_dir: Path):
    handle = service.create_custom_loss(plain_is, {"logprobs": 1, "old": 1, "adv": 1}).result()
    custom = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=31).result()
    builtin = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=31).result()
    lp = forward_logprobs(custom, IDS)
    rng = np.random.default_rng(2)
    old = (lp + rng.uniform(-0.3, 0.3, lp.shape)).astype(np.float32)
    adv = rng.normal(0, 1, lp.shape).astype(np.float32)
    got = custom.forward_backward_custom([rl_datum(IDS, old, adv)], handle).result()
    want = builtin.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(IDS[:-1]),
                                                 loss_fn_inputs={"target_tokens": IDS[1:], "logprobs": old,
                                                                 "advantages": adv})],
                                    "importance_sampling").result()
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    assert got.metrics["custom/loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    for client in (custom, builtin):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = forward_logprobs(custom, IDS)
    assert not np.allclose(after, lp, atol=1e-4)  # it trained
    np.testing.assert_allclose(after, forward_logprobs(builtin, IDS), atol=1e-6)


def test_ops_outside_the_set_are_refused_and_the_session_goes_on(service: tinker.ServiceClient,
                                                                 server: TinkerServer, tiny_model_dir: Path):
    def noisy(logprobs, adv):  # randomness: torch allows it, the server's op set does not (runs must replay)
        return -(logprobs * adv * torch.rand_like(adv)).sum(), {}

    def in_place(logprobs, adv):
        return -(logprobs * adv.copy_(logprobs)).sum(), {}

    for fn, what in ((noisy, "torch.rand_like"), (in_place, "copy_")):
        with pytest.raises(tinker.BadRequestError, match=what) as err:
            service.create_custom_loss(fn, {"logprobs": 1, "adv": 1}).result()
        assert err.value.status_code == 400 and err.value.body["category"] == "user"
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=32).result()
    with pytest.raises(tinker.BadRequestError, match="loss_id") as failed:  # refused at once, its seq_id freed
        tc.forward_backward([rl_datum(IDS, np.zeros(23, np.float32), np.ones(23, np.float32))], "custom",
                            {"loss_id": "nobody:loss:0"}).result()
    assert failed.value.body["category"] == "user"
    handle = service.create_custom_loss(plain_is, {"logprobs": 1, "old": 1, "adv": 1}).result()  # the next seq
    lp = forward_logprobs(tc, IDS)
    out = tc.forward_backward_custom([rl_datum(IDS, lp, np.ones_like(lp))], handle).result()
    assert out.metrics["loss:sum"] == pytest.approx(-23.0, rel=1e-4)  # ratio 1 everywhere
    # a graph sent by hand: a captured tensor (get_attr) and a node referring to a later one are refused
    session = handle.session_id
    for nodes, what in (
        ([{"op": "placeholder", "name": "logprobs", "target": "logprobs"},
          {"op": "get_attr", "name": "w", "target": "w"},
          {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"ref": "w"}, {"dict": {}}]}]}],
         "get_attr"),
        ([{"op": "placeholder", "name": "logprobs", "target": "logprobs"},
          {"op": "call_method", "name": "s", "target": "sum", "args": [{"ref": "later"}]},
          {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}]}],
         "not an earlier node")):
        body = {"session_id": session, "custom_loss_seq_id": 100 + len(what), "name": "hand",
                "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"format": 1, "nodes": nodes}}
        reply = httpx.post(f"{server.url}/api/v1/create_custom_loss", json=body, headers={"X-API-Key": KEY})
        assert reply.status_code == 400 and what in reply.json()["error"], reply.text
        assert reply.json()["category"] == "user"
