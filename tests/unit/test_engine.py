"""The embedded engine, in process (httpx ASGITransport), against the SGLang contract.

Covers generation from input_ids and text, logprob agreement (batched vs alone
vs the trainer's full-sequence forward pass), stop tokens, weight updates from
disk, 400s for bad input, pause/continue and abort.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from safetensors.torch import load_file, save_file

from services.contracts.sglang_api import GenerateReqOutput
from services.inference.generator import Engine
from tests.helpers import ADMIN, asgi_client, engine_app


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path) -> Iterator[FastAPI]:
    with engine_app(tiny_model_dir, weight_version=0, max_batch=64, engine_id="test-engine") as app:
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(app, base_url="http://engine", http_timeout_s=60.0, headers=ADMIN) as c:
        yield c


def _engine(app: FastAPI) -> Engine:
    return app.state.engine


async def _gen(client: httpx.AsyncClient, **body: Any) -> GenerateReqOutput:
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return GenerateReqOutput.model_validate(resp.json())


async def _wait_queued(client: httpx.AsyncClient, n: int) -> None:
    for _ in range(200):
        load = (await client.get("/get_load")).json()[0]
        if load["num_waiting_reqs"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} requests never queued")


def _full_forward_logprobs(engine: Engine, prompt: list[int], output: list[int],
                           temperature: float) -> list[float]:
    """What the trainer computes: logits[:, :-1] of prompt+output, log_softmax(logits / T), gather."""
    seq = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = engine.model(seq).logits[:, :-1].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1).gather(2, seq[:, 1:, None]).squeeze(0).squeeze(-1)
    return lp[len(prompt) - 1 :].tolist()


@pytest.fixture(scope="module")
def resolved_model_dir(tiny_model_dir: Path) -> str:
    return str(tiny_model_dir.resolve())


async def test_info_endpoints(client: httpx.AsyncClient, resolved_model_dir: str) -> None:
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/health_generate")).status_code == 200
    info = (await client.get("/get_model_info")).json()
    assert info["is_generation"] is True and info["model_path"] == resolved_model_dir
    assert info["tokenizer_path"] == info["model_path"] and info["weight_version"] == "0"
    server = (await client.get("/get_server_info")).json()
    assert server["max_batch"] == 64 and server["weight_version"] == "0" and server["version"]
    assert (await client.get("/server_info")).json()["model_path"] == info["model_path"]
    assert (await client.get("/get_weight_version")).json() == {"weight_version": "0"}
    assert (await client.post("/flush_cache")).status_code == 200
    load = (await client.get("/get_load")).json()
    assert load[0]["num_reqs"] == 0 and "num_tokens" in load[0]


async def test_generate_input_ids_and_text(client: httpx.AsyncClient, app: FastAPI) -> None:
    sampling = {"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": 1}
    out = await _gen(client, input_ids=[5, 6, 7], sampling_params=sampling, return_logprob=True, rid="ids-1")
    meta = out.meta_info
    assert meta.id == "ids-1" and meta.prompt_tokens == 3 and meta.weight_version == "0"
    assert len(out.output_ids) == meta.completion_tokens == len(meta.output_token_logprobs or [])
    assert [t for _, t, _ in meta.output_token_logprobs or []] == out.output_ids
    assert all(lp <= 0 for lp, _, _ in meta.output_token_logprobs or [])
    assert meta.model_extra and meta.model_extra["engine"] == "test-engine"
    if meta.finish_reason.type == "length":
        assert meta.finish_reason.length == 6 == len(out.output_ids)
    again = await _gen(client, input_ids=[5, 6, 7], sampling_params=sampling)
    assert again.output_ids == out.output_ids  # same seed, same tokens
    text = await _gen(client, text="hello", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert text.meta_info.prompt_tokens == len(_engine(app).tokenizer("hello")["input_ids"])
    assert text.meta_info.output_token_logprobs is None
    zero = await _gen(client, input_ids=[5], sampling_params={"max_new_tokens": 0})
    assert zero.output_ids == [] and zero.meta_info.finish_reason.type == "length"


async def test_logprobs_batched_vs_single_vs_full_forward(client: httpx.AsyncClient,
                                                          app: FastAPI) -> None:
    engine = _engine(app)
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [100], [40, 41, 42, 43], [70, 71], [9] * 12]
    temps = [0.7, 1.0, 0.0, 1.3, 0.0, 0.9]
    bodies = [{"input_ids": p, "return_logprob": True, "rid": f"b{i}",
               "sampling_params": {"max_new_tokens": 10, "temperature": t, "sampling_seed": 100 + i,
                                   "top_p": 0.95 if i == 3 else 1.0, "top_k": 20 if i == 5 else -1}}
              for i, (p, t) in enumerate(zip(prompts, temps, strict=True))]
    # Pause so that all six are queued, then continue: the worker runs them as one batch.
    assert (await client.post("/pause_generation")).status_code == 200
    tasks = [asyncio.create_task(_gen(client, **b)) for b in bodies]
    await _wait_queued(client, len(bodies))
    assert (await client.post("/continue_generation")).status_code == 200
    batched = await asyncio.gather(*tasks)
    for body, b in zip(bodies, batched, strict=True):
        alone = await _gen(client, **body)
        assert alone.output_ids == b.output_ids
        lp_b = [lp for lp, _, _ in b.meta_info.output_token_logprobs or []]
        lp_a = [lp for lp, _, _ in alone.meta_info.output_token_logprobs or []]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b, strict=True)) < 1e-4
        full = _full_forward_logprobs(engine, body["input_ids"], b.output_ids,
                                      body["sampling_params"]["temperature"])
        assert max(abs(x - y) for x, y in zip(full, lp_b, strict=True)) < 1e-4


async def test_stop_token_included(client: httpx.AsyncClient, app: FastAPI,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sampling = {"max_new_tokens": 12, "temperature": 0.9, "sampling_seed": 7}
    base = await _gen(client, input_ids=[20, 21, 22], sampling_params=sampling, return_logprob=True)
    assert len(base.output_ids) >= 4
    stop = base.output_ids[3]
    cut = base.output_ids.index(stop) + 1
    out = await _gen(client, input_ids=[20, 21, 22], return_logprob=True,
                     sampling_params={**sampling, "stop_token_ids": [stop]})
    assert out.output_ids == base.output_ids[:cut] and out.output_ids[-1] == stop
    assert out.meta_info.finish_reason.type == "stop" and out.meta_info.finish_reason.matched == stop
    assert len(out.meta_info.output_token_logprobs or []) == cut  # the stop token has its logprob
    # The tokenizer's EOS always stops, without being asked for.
    monkeypatch.setattr(_engine(app), "eos_ids", frozenset({stop}))
    eos = await _gen(client, input_ids=[20, 21, 22], sampling_params=sampling)
    assert eos.output_ids == out.output_ids and eos.meta_info.finish_reason.matched == stop


@pytest.mark.parametrize("body, needle", [
    ({"input_ids": [1, 2], "bogus": 1}, "bogus"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 10**6]}, "vocab"),
    ({"input_ids": [1, 2], "text": "x"}, "exactly one"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1, 2], "return_hidden_states": True}, "return_hidden_states"),
    ([1, 2, 3], "JSON object"),
])
async def test_bad_generate_is_400(client: httpx.AsyncClient, body: Any, needle: str) -> None:
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["object"] == "error" and err["code"] == 400 and needle in err["message"]


async def test_bad_bodies_elsewhere_are_400(client: httpx.AsyncClient) -> None:
    resp = await client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["message"]
    resp = await client.post("/update_weights_from_disk", json={"model_path": "/x", "nope": 1})
    assert resp.status_code == 400 and "nope" in resp.json()["message"]
    resp = await client.post("/update_weights_from_disk", json={"model_path": "/x", "weight_version": "v2"})
    assert resp.status_code == 400 and "integer" in resp.json()["message"]
    resp = await client.post("/abort_request", json={})
    assert resp.status_code == 400 and "rid" in resp.json()["message"]
    assert (await client.get("/health")).status_code == 200  # still alive


async def test_pause_continue_and_abort(client: httpx.AsyncClient) -> None:
    await client.post("/pause_generation")
    a = asyncio.create_task(_gen(client, input_ids=[5, 6], rid="a", sampling_params={"max_new_tokens": 4}))
    b = asyncio.create_task(_gen(client, input_ids=[7, 8], rid="b", sampling_params={"max_new_tokens": 4}))
    await _wait_queued(client, 2)
    await asyncio.sleep(0.1)
    assert not a.done() and not b.done()  # paused: they wait
    assert (await client.post("/abort_request", json={"rid": "a"})).json()["num_aborted"] == 1
    aborted = await a
    assert aborted.meta_info.finish_reason.type == "abort" and aborted.output_ids == []
    await client.post("/continue_generation")
    done = await b
    assert done.meta_info.finish_reason.type in ("length", "stop") and done.output_ids
    # Abort a running request: greedy on this prompt runs to max_new_tokens unless stopped.
    long = asyncio.create_task(_gen(client, input_ids=[78, 78], rid="long", return_logprob=True,
                                    sampling_params={"max_new_tokens": 1000, "temperature": 0}))
    for _ in range(500):
        load = (await client.get("/get_load")).json()[0]
        if load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0 and load["num_tokens"] > 10:
            break
        await asyncio.sleep(0.005)
    assert (await client.post("/abort_request", json={"abort_all": True})).json()["num_aborted"] == 1
    cut = await long
    assert cut.meta_info.finish_reason.type == "abort" and 0 < len(cut.output_ids) < 1000
    assert len(cut.meta_info.output_token_logprobs or []) == len(cut.output_ids)


def _perturbed_copy(src: Path, dst: Path, scale: float = 0.05) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        state = load_file(str(f))
        gen = torch.Generator().manual_seed(0)
        save_file({k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}, str(f),
                  metadata={"format": "pt"})
    return dst


async def test_update_weights_from_disk(client: httpx.AsyncClient, app: FastAPI, tiny_model_dir: Path,
                                        tmp_path: Path) -> None:
    body = {"input_ids": [30, 31, 32], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    before = await _gen(client, **body)
    new_dir = _perturbed_copy(tiny_model_dir, tmp_path / "v5")
    try:
        resp = await client.post("/update_weights_from_disk",
                                 json={"model_path": str(new_dir), "weight_version": "5"})
        assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
        assert (await client.get("/get_weight_version")).json() == {"weight_version": "5"}
        after = await _gen(client, **body)
        assert after.meta_info.weight_version == "5"
        assert after.meta_info.output_token_logprobs != before.meta_info.output_token_logprobs
        full = _full_forward_logprobs(_engine(app), body["input_ids"], after.output_ids, 0.0)
        got = [lp for lp, _, _ in after.meta_info.output_token_logprobs or []]
        assert max(abs(x - y) for x, y in zip(full, got, strict=True)) < 1e-4
        # No version given: +1. A bad path: success false, 400, nothing changes.
        resp = await client.post("/update_weights_from_disk", json={"model_path": str(new_dir)})
        assert resp.json()["success"] is True
        assert (await client.get("/get_weight_version")).json()["weight_version"] == "6"
        resp = await client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
        assert resp.status_code == 400 and resp.json()["success"] is False
        broken = tmp_path / "broken"
        broken.mkdir()
        save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(broken / "model.safetensors"))
        resp = await client.post("/update_weights_from_disk", json={"model_path": str(broken)})
        assert resp.status_code == 400 and "missing" in resp.json()["message"]
        assert (await _gen(client, **body)).output_ids == after.output_ids
    finally:
        resp = await client.post("/update_weights_from_disk",
                                 json={"model_path": str(tiny_model_dir), "weight_version": "0"})
        assert resp.json()["success"] is True
    restored = await _gen(client, **body)
    assert restored.output_ids == before.output_ids and restored.meta_info.weight_version == "0"
    assert json.dumps(restored.meta_info.output_token_logprobs) == json.dumps(
        before.meta_info.output_token_logprobs)


async def test_admin_routes_need_the_admin_token(app: FastAPI, tiny_model_dir: Path) -> None:
    """Without the bearer token (or with another) every admin route answers 401 before reading its body, so a
    probe learns nothing of the disk; an engine started without a token keeps its admin routes closed."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        async with asgi_client(app, base_url="http://engine", headers=headers) as anon:
            probe = await anon.post("/update_weights_from_disk", json={"model_path": "/etc"})
            assert probe.status_code == 401 and "/etc" not in probe.text
            assert "Authorization: Bearer" in probe.json()["error"]["message"]
            for path in ("/flush_cache", "/pause_generation", "/continue_generation", "/abort_request"):
                assert (await anon.post(path, json={})).status_code == 401, path
            assert (await anon.get("/get_model_info")).status_code == 200
    assert not _engine(app).paused
    with engine_app(tiny_model_dir, admin_token=None) as closed:
        async with asgi_client(closed, headers=ADMIN) as c:
            resp = await c.post("/pause_generation")
            assert resp.status_code == 401 and "TANDEM_ADMIN_TOKEN" in resp.text
