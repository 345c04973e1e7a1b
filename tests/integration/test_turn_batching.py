"""The rollout batches the turns of one bus read into batch ``/generate`` calls (services/rollout/batcher.py),
through the real SGLang router and a real embedded engine, the turns consumed from a real Redis stream.

Each reply is the one its own request would get (greedy: the same tokens, request by request), every entry
is acknowledged once, and a bad prompt in a batch is rejected alone while the others are answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.admin_token import ADMIN_TOKEN_ENV
from services.common.bus import Bus
from services.contracts.codec import FIELD, decode
from services.contracts.config import TandemConfig, parse_config
from services.contracts.messages import DeadLetter, GenerateReply, GenerateRequest, SamplingParams
from services.rollout.engine_client import EngineClient
from services.rollout.service import RolloutService
from tests.helpers import ADMIN_TOKEN, engines_behind_router


@pytest.fixture(scope="module")
def router(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real embedded engine behind the real SGLang router: the router's URL."""
    with engines_behind_router(tiny_model_dir, tmp_path_factory.mktemp("batch-router"), ["A-0"]) as (router_url, _):
        yield router_url


def config(tmp_path: Path, model: Path) -> TandemConfig:
    return parse_config({"run": {"name": "t", "checkpoint_root": str(tmp_path / "ck"), "total_steps": 3},
                         "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                         "agents": {"A": {"model_path": str(model)}}})


def turn(i: int, ids: list[int], reply_stream: str) -> GenerateRequest:
    return GenerateRequest(agent="A", episode_id=f"e{i}", group_id="g", turn=0, role="X", input_ids=ids,
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=4), reply_stream=reply_stream)


async def consume_until(bus: Bus, rollout: RolloutService, stream: str, settled: int) -> None:
    """Run the rollout's turns consumer until ``settled`` entries are acknowledged."""
    s, stop = bus.streams, asyncio.Event()
    task = asyncio.create_task(bus.consume(s.turns("A"), "rollout", bus.service, rollout.on_turn, stop,
                                           concurrency=rollout.concurrency, count=64))
    try:
        for _ in range(600):
            groups = await bus.redis.xinfo_groups(stream)
            if groups and int(groups[0]["pending"]) == 0 and int(groups[0]["entries-read"] or 0) >= settled:
                break
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task


async def test_one_read_of_turns_goes_as_batch_calls_each_reply_its_own(
        redis_url: str, tiny_model_dir: Path, tmp_path: Path, router: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
    bus = Bus(redis_url, "t", "rollout-A")
    s = bus.streams
    prompts = [[5 + i, 6 + (i * 7) % 50, 7 + (i * 3) % 40] for i in range(24)]
    async with EngineClient(router, token=ADMIN_TOKEN) as client:  # each prompt alone: the expected tokens
        alone = [await client.generate(p, {"temperature": 0.0, "max_new_tokens": 4}, f"alone-{i}")
                 for i, p in enumerate(prompts)]
    reqs = [turn(i, p, s.replies("batch")) for i, p in enumerate(prompts)]
    for r in reqs:  # all on the stream before the consumer starts: one read takes them all
        await bus.publish(s.turns("A"), r)
    rollout = await RolloutService.start(config(tmp_path, tiny_model_dir), "A", bus, router)
    try:
        await consume_until(bus, rollout, s.turns("A"), len(reqs))
        assert rollout.batcher.batch_calls >= 1 and rollout.batcher.batched_turns == len(reqs)
    finally:
        await rollout.close()
    replies = {r.request_id: r for r in [decode(f[FIELD], GenerateReply)
                                         for _, f in await bus.redis.xrange(s.replies("batch"))]}
    assert sorted(replies) == sorted(r.id for r in reqs)  # one reply each, none twice
    for req, want in zip(reqs, alone, strict=True):
        got = replies[req.id]
        assert (got.episode_id, got.error) == (req.episode_id, None)
        assert got.output_ids == want.output_ids and got.prompt_tokens == len(req.input_ids)
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-4)
        assert all(lp <= 0 for lp in got.output_logprobs)
    assert await bus.redis.xlen(s.deadletter) == 0
    await bus.close()


async def test_a_bad_prompt_in_a_batch_is_rejected_alone(redis_url: str, tiny_model_dir: Path, tmp_path: Path,
                                                         router: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
    bus = Bus(redis_url, "t2", "rollout-A")
    s = bus.streams
    reqs = [turn(i, [5 + i, 6, 7], s.replies("bad")) for i in range(6)]
    reqs[3] = turn(3, [5, 10**6, 7], s.replies("bad"))  # outside the vocabulary: the engine answers 400
    for r in reqs:
        await bus.publish(s.turns("A"), r)
    rollout = await RolloutService.start(config(tmp_path, tiny_model_dir), "A", bus, router)
    try:
        await consume_until(bus, rollout, s.turns("A"), len(reqs))
    finally:
        await rollout.close()
    replies = {r.request_id: r for r in [decode(f[FIELD], GenerateReply)
                                         for _, f in await bus.redis.xrange(s.replies("bad"))]}
    assert sorted(replies) == sorted(r.id for r in reqs)
    assert "out of vocabulary" in (replies[reqs[3].id].error or "") and not replies[reqs[3].id].output_ids
    assert all(replies[r.id].error is None and replies[r.id].output_ids for i, r in enumerate(reqs) if i != 3)
    (letter,) = [decode(f[FIELD], DeadLetter) for _, f in await bus.redis.xrange(s.deadletter)]
    assert "out of vocabulary" in letter.reason and letter.source_stream == s.turns("A")
    await bus.close()
