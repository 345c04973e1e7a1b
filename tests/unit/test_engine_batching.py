"""Continuous batching, trainer-exact logprobs and versioned weight updates of the embedded engine.

Every logprob is checked against the trainer's own ``token_logprobs`` over the full sequence
(a separate model instance loaded from the same weights, float32), also for requests that joined a
running batch and for rows that ran while others left. Weight updates run while requests are in
flight: without a pause each request runs wholly on one version; paused in place, the reply's
SGLang ``weight_versions`` spans say which version produced which tokens.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from services.training.grpo import token_logprobs
from tests.helpers import ADMIN, asgi_client, engine_app


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path) -> Iterator[FastAPI]:
    with engine_app(tiny_model_dir, weight_version=0, max_batch=8) as app:
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(app, headers=ADMIN) as c:
        yield c


@pytest.fixture(scope="module")
def perturbed_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("perturbed") / "model"
    shutil.copytree(tiny_model_dir, dst)
    for f in dst.glob("*.safetensors"):
        gen = torch.Generator().manual_seed(1)
        state = load_file(str(f))
        save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}, str(f),
                  metadata={"format": "pt"})
    return dst


def trainer_logprobs(model_dir: Path, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """What the trainer computes for the generated tokens: full-sequence forward, token_logprobs."""
    model = _model(str(model_dir))
    seq = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(seq).logits[:, :-1]
    return token_logprobs(logits, seq[:, 1:], temperature)[0, len(prompt) - 1:].tolist()


_MODELS: dict[str, Any] = {}


def _model(path: str) -> Any:
    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[path]


async def _gen(client: httpx.AsyncClient, prompt: list[int], **sp: Any) -> dict[str, Any]:
    resp = await client.post("/generate", json={"input_ids": prompt, "return_logprob": True,
                                                "sampling_params": {"ignore_eos": True, **sp}})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _lps(reply: dict[str, Any]) -> list[float]:
    return [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def _until(pred: Any, what: str) -> None:
    for _ in range(2000):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def test_join_and_leave_keep_trainer_logprobs(client: httpx.AsyncClient, app: FastAPI,
                                                    tiny_model_dir: Path) -> None:
    engine = app.state.engine
    stats0 = dict(engine.stats)
    long = asyncio.create_task(_gen(client, [5, 6, 7], max_new_tokens=48, temperature=1.0, sampling_seed=1))
    await _until(lambda: engine.stats["decode_steps"] >= stats0["decode_steps"] + 5, "long request decoding")
    # join a running batch: different prompt lengths, temperatures, top-p/top-k; they leave before `long`
    specs = [([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], 0.7, {"top_p": 0.9}),
             ([100], 1.3, {"top_k": 12}), ([40, 41, 42, 43], 0.0, {})]
    mids = [asyncio.create_task(_gen(client, p, max_new_tokens=6 + 3 * i, temperature=t, sampling_seed=10 + i, **kw))
            for i, (p, t, kw) in enumerate(specs)]
    mid = await asyncio.gather(*mids)
    late = await _gen(client, [9] * 20, max_new_tokens=5, temperature=0.9, sampling_seed=5)  # joins after they left
    first = await long
    assert engine.stats["joined_running"] - stats0["joined_running"] >= 4
    assert engine.stats["left_running"] - stats0["left_running"] >= 4
    cases = [([5, 6, 7], 1.0, first), *[(p, t, r) for (p, t, _), r in zip(specs, mid, strict=True)],
             ([9] * 20, 0.9, late)]
    for prompt, temp, reply in cases:
        assert reply["meta_info"]["finish_reason"]["type"] == "length"
        assert _close(trainer_logprobs(tiny_model_dir, prompt, reply["output_ids"], temp), _lps(reply)) < 1e-4
    # the same seed alone gives the same tokens: the batch a request ran in does not change it
    alone = await _gen(client, [5, 6, 7], max_new_tokens=48, temperature=1.0, sampling_seed=1)
    assert alone["output_ids"] == first["output_ids"]


async def test_update_waits_for_running_requests(client: httpx.AsyncClient, app: FastAPI, tiny_model_dir: Path,
                                                 perturbed_dir: Path) -> None:
    engine = app.state.engine
    old = [asyncio.create_task(_gen(client, [20 + i, 21, 22], max_new_tokens=24, temperature=1.0, sampling_seed=i))
           for i in range(3)]
    await _until(lambda: engine.load()["num_reqs"] == 3 and not engine.load()["num_waiting_reqs"], "3 running")
    update = asyncio.create_task(client.post("/update_weights_from_disk",
                                             json={"model_path": str(perturbed_dir), "weight_version": "7"}))
    await _until(lambda: bool(engine._ops), "update queued")
    new = [asyncio.create_task(_gen(client, [30 + i, 31], max_new_tokens=8, temperature=0.8, sampling_seed=i))
           for i in range(2)]
    old_replies = await asyncio.gather(*old)
    resp = await update
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    new_replies = await asyncio.gather(*new)
    try:
        for i, r in enumerate(old_replies):  # in flight: not dropped, wholly on version 0
            meta = r["meta_info"]
            assert meta["weight_version"] == "0" and len(r["output_ids"]) == 24
            assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 24}]
            assert _close(trainer_logprobs(tiny_model_dir, [20 + i, 21, 22], r["output_ids"], 1.0), _lps(r)) < 1e-4
        for i, r in enumerate(new_replies):  # queued during the update: wholly on version 7
            assert r["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 8}]
            assert _close(trainer_logprobs(perturbed_dir, [30 + i, 31], r["output_ids"], 0.8), _lps(r)) < 1e-4
    finally:
        resp = await client.post("/update_weights_from_disk",
                                 json={"model_path": str(tiny_model_dir), "weight_version": "0"})
        assert resp.json()["success"]


NEW = 400  # new tokens of the request paused in place


async def test_update_while_paused_in_place_reports_spans(client: httpx.AsyncClient, app: FastAPI,
                                                          tiny_model_dir: Path, perturbed_dir: Path) -> None:
    engine = app.state.engine
    # long enough that the pause lands mid-generation even on a loaded machine (_gen ignores EOS)
    task = asyncio.create_task(_gen(client, [50, 51], max_new_tokens=NEW, temperature=1.0, sampling_seed=3))
    await _until(lambda: engine.load()["num_tokens"] >= 2 + 6, "some tokens")
    assert (await client.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
    resp = await client.post("/update_weights_from_disk", json={"model_path": str(perturbed_dir),
                                                                 "weight_version": "8"})
    try:
        assert resp.json()["success"] and resp.json()["num_paused_requests"] == 1
        assert not task.done()
        await client.post("/continue_generation")
        reply = await task
        spans = reply["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == ["0", "8"] and spans[0]["start"] == 0
        assert spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == NEW and spans[0]["end"] >= 6
        assert reply["meta_info"]["weight_version"] == "8"
        k = spans[0]["end"]  # the tokens made before the switch are exactly version 0's
        ref = trainer_logprobs(tiny_model_dir, [50, 51], reply["output_ids"][:k], 1.0)
        assert _close(ref, _lps(reply)[:k]) < 1e-4
    finally:
        await client.post("/continue_generation")
        await client.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "0"})


async def test_n_samples_stop_strings_and_pause_abort(client: httpx.AsyncClient, app: FastAPI) -> None:
    resp = await client.post("/generate", json={"input_ids": [5, 6], "rid": "multi", "sampling_params": {
        "n": 3, "max_new_tokens": 6, "sampling_seed": 2, "ignore_eos": True}})
    outs = resp.json()
    assert isinstance(outs, list) and [o["meta_info"]["id"] for o in outs] == ["multi-0", "multi-1", "multi-2"]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # distinct samples
    tok = app.state.engine.tokenizer
    base = await _gen(client, [60, 61], max_new_tokens=12, temperature=0.0)
    text = tok.decode(base["output_ids"])
    needle = text[4:6]
    cut = await _gen(client, [60, 61], max_new_tokens=12, temperature=0.0, stop=[needle])
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": needle}
    assert needle in tok.decode(cut["output_ids"]) and len(cut["output_ids"]) < len(base["output_ids"])
    # pause in SGLang's default mode (abort) returns the running request as aborted
    task = asyncio.create_task(_gen(client, [7], max_new_tokens=500, temperature=0.0))
    await _until(lambda: app.state.engine.load()["num_tokens"] > 5, "running")
    assert (await client.post("/pause_generation")).json()["num_aborted"] == 1
    assert (await task)["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await client.post("/continue_generation")).status_code == 200
