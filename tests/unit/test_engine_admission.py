"""The embedded engine under load: admission in short windows and SGLang's batch ``/generate``.

Requests that arrive together share one prefill and decode in step (one decode step per token
after the first, not one prefill per request); the admission window is capped (a lone request is
not held back longer than ``admit_window_s``) and a queue that fills the batch's room is admitted
at once. A batch ``/generate`` (``input_ids`` a list of lists) answers a list in SGLang's shape,
each prompt's tokens and logprobs those it gets alone with the same seed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.contracts.sglang_api import GenerateReqOutput
from services.inference.generator import Engine
from services.inference.request import GenRequest
from tests.helpers import asgi_client, engine_app


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path) -> Iterator[FastAPI]:
    # a wide quiet time, so that requests sent together are admitted together even on a loaded machine
    with engine_app(tiny_model_dir, max_batch=32, engine_id="adm", admit_quiet_s=0.25, admit_window_s=2.0) as app:
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(app) as c:
        yield c


def _body(prompt: Any, seed: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed},
            **extra}


def _lps(reply: dict[str, Any]) -> list[float]:
    return [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]


async def _post(client: httpx.AsyncClient, body: Any) -> Any:
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_concurrent_requests_share_one_prefill(client: httpx.AsyncClient, app: FastAPI) -> None:
    engine = app.state.engine
    before = dict(engine.stats)
    prompts = [[5 + i, 6, 7 + i % 3] for i in range(16)]
    replies = await asyncio.gather(*(_post(client, _body(p, i)) for i, p in enumerate(prompts)))
    assert engine.stats["prefills"] - before["prefills"] == 1
    assert engine.stats["decode_steps"] - before["decode_steps"] == 11  # the first token comes with the prefill
    for r in replies:
        GenerateReqOutput.model_validate(r)
        assert set(r) == {"text", "output_ids", "meta_info"} and len(r["output_ids"]) == 12


async def test_batch_generate_matches_single_requests(client: httpx.AsyncClient, app: FastAPI) -> None:
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14], [100]]
    alone = [await _post(client, _body(p, 40 + i)) for i, p in enumerate(prompts)]
    sampling = [{"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 40 + i}
                for i in range(3)]
    batch = await _post(client, {"input_ids": prompts, "return_logprob": True, "rid": "bat",
                                 "sampling_params": sampling})
    assert isinstance(batch, list) and [r["meta_info"]["id"] for r in batch] == ["bat_0", "bat_1", "bat_2"]
    for one, many in zip(alone, batch, strict=True):
        GenerateReqOutput.model_validate(many)
        assert many["output_ids"] == one["output_ids"]
        assert max(abs(x - y) for x, y in zip(_lps(one), _lps(many), strict=True)) < 1e-4
        assert many["meta_info"]["engine"] == "adm" and many["meta_info"]["prompt_tokens"] > 0
    # shared sampling params, a rid per prompt, logprobs for one prompt only, n = 2 samples each
    shared = await _post(client, {"input_ids": prompts[:2], "rid": ["x", "y"], "return_logprob": [True, False],
                                  "sampling_params": {"max_new_tokens": 4, "n": 2, "sampling_seed": 1}})
    assert [r["meta_info"]["id"] for r in shared] == ["x-0", "x-1", "y-0", "y-1"]
    assert ["output_token_logprobs" in r["meta_info"] for r in shared] == [True, True, False, False]
    texts = await _post(client, {"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert len(texts) == 2 and all(len(r["output_ids"]) <= 2 for r in texts)


@pytest.mark.parametrize("body, needle", [
    ({"input_ids": [[1, 2], [3]], "rid": ["only-one"]}, "rid has 1 entries for a batch of 2"),
    ({"input_ids": [[1, 2], []]}, "item 1: "),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": -1}]},
     "item 1: sampling_params.max_new_tokens"),
    ({"text": []}, "non-empty list of prompts"),
    ({"input_ids": [[1, 2], [3]], "bogus": 1}, "bogus"),
])
async def test_bad_batches_are_400(client: httpx.AsyncClient, body: dict[str, Any], needle: str) -> None:
    resp = await client.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]


async def _generate(engine: Engine, n: int, max_new_tokens: int = 3) -> list[GenRequest]:
    reqs = [GenRequest(rid=f"r{i}", input_ids=[5 + i, 6], max_new_tokens=max_new_tokens, ignore_eos=True, seed=i)
            for i in range(n)]
    return await engine.generate_many(reqs)


async def test_admission_window_is_capped_and_a_full_room_goes_at_once(tiny_model_dir: Path) -> None:
    # the quiet time alone would hold a lone request for a minute: the window admits it after 0.2 s
    engine = Engine(tiny_model_dir, max_batch=4, admit_quiet_s=60.0, admit_window_s=0.2)
    try:
        start = time.monotonic()
        (lone,) = await _generate(engine, 1)
        assert 0.2 <= time.monotonic() - start < 30 and len(lone.output_ids) == 3
        # four requests fill the batch's room: admitted at once, in one prefill, without waiting
        engine.admit_window_s = 60.0
        before = engine.stats["prefills"]
        start = time.monotonic()
        done = await asyncio.wait_for(_generate(engine, 4), timeout=30)
        assert [len(r.output_ids) for r in done] == [3] * 4 and engine.stats["prefills"] - before == 1
        assert time.monotonic() - start < 30
    finally:
        engine.stop()


async def test_requests_join_a_running_batch_after_the_quiet_time(tiny_model_dir: Path) -> None:
    engine = Engine(tiny_model_dir, max_batch=8, admit_quiet_s=0.05, admit_window_s=5.0)
    try:
        long = asyncio.create_task(_generate(engine, 1, max_new_tokens=400))
        for _ in range(2000):
            if engine.stats["decode_steps"] >= 3:
                break
            await asyncio.sleep(0.005)
        late = await _generate(engine, 3)  # one prefill for the three, while the long request decodes on
        assert engine.stats["joined_running"] == 3 and engine.stats["prefills"] == 2
        assert not long.done() and all(len(r.output_ids) == 3 for r in late)
        engine.abort(abort_all=True)
        assert (await long)[0].finish["type"] == "abort"
    finally:
        engine.stop()


async def test_a_call_of_several_requests_is_admitted_without_the_wait(tiny_model_dir: Path) -> None:
    """A batch call (the rollout gathered the turns of one read) is its own admission window."""
    engine = Engine(tiny_model_dir, max_batch=8, admit_quiet_s=60.0, admit_window_s=60.0)
    try:
        done = await asyncio.wait_for(_generate(engine, 3), timeout=30)  # three of eight: the room is not full
        assert [len(r.output_ids) for r in done] == [3] * 3 and engine.stats["prefills"] == 1
    finally:
        engine.stop()
