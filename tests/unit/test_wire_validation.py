"""Well-formed but wrong input at the trust boundaries (real Redis, the real tiny model's config):
strict wire types, non-negative ids and finite logprobs <= 0 at the contract; ids outside the agent's
vocabulary rejected alone at the buffer (the group abandoned at once); an engine's bad reply never
passed on by the rollout (an SGLang-shaped server that misbehaves stands in for the GPU server)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from pydantic import ValidationError

from services.buffer.service import BufferService
from services.common.bus import Bus, Reject
from services.common.tokens import ids_problem, logprobs_problem, vocab_size
from services.contracts.codec import FIELD, decode, encode
from services.contracts.config import TandemConfig, parse_config
from services.contracts.messages import (
    Batch,
    DeadLetter,
    Event,
    GenerateReply,
    GenerateRequest,
    Sample,
    SamplingParams,
)
from services.rollout.engine_client import EngineClient
from services.rollout.service import RolloutService
from tests.helpers import emit

GOOD: dict[str, Any] = {"agent": "A", "role": "X", "episode_id": "e", "group_id": "g", "group_samples": 2,
                        "tokens": [5, 6, 40], "loss_mask": [0, 1, 1], "rollout_logprobs": [0.0, -1.0, -0.5],
                        "reward": 1.0, "weight_versions": [0]}


def config(tmp_path: Path, model: Path) -> TandemConfig:
    return parse_config({"run": {"name": "wv", "checkpoint_root": str(tmp_path / "ck"), "total_steps": 2},
                         "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                         "agents": {"A": {"model_path": str(model), "groups_per_batch": 1}}})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.5])
def test_sample_and_reply_logprobs_must_be_finite_and_at_most_zero(bad: float) -> None:
    with pytest.raises(ValidationError, match="rollout_logprobs"):
        Sample(**{**GOOD, "rollout_logprobs": [0.0, bad, -0.5]})
    with pytest.raises(ValidationError, match="output_logprobs"):
        GenerateReply(request_id="r", agent="A", episode_id="e", turn=0, output_ids=[1], output_logprobs=[bad],
                      finish_reason="stop", weight_version=0, engine="x")


def test_token_ids_are_non_negative_and_wire_types_strict() -> None:
    for field, value in (("tokens", [5, -5, 40]), ("tokens", [5, True, 40]), ("reward", "1.0"),
                         ("group_samples", 2.0), ("weight_versions", ["0"])):
        with pytest.raises(ValidationError, match=field):
            Sample(**{**GOOD, field: value})
    with pytest.raises(ValidationError, match="input_ids"):
        GenerateRequest(agent="A", episode_id="e", group_id="g", turn=0, role="X", input_ids=[-1],
                        sampling=SamplingParams(), reply_stream="r")
    with pytest.raises(ValidationError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-2])
    raw = msgpack.packb({**Sample(**GOOD).model_dump(), "reward": "1.0"}, use_bin_type=True)
    with pytest.raises(ValidationError, match="reward"):  # what a consumer decodes is strict too
        decode(raw, Sample)
    assert decode(msgpack.packb(Sample(**GOOD).model_dump(), use_bin_type=True), Sample).tokens == [5, 6, 40]


def test_token_checks_against_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    vocab = vocab_size(str(tiny_model_dir))
    assert vocab == json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"] and vocab > 0
    assert ids_problem([0, vocab - 1], vocab, "tokens") is None
    assert ids_problem([3, vocab], vocab, "tokens") == (f"tokens[1] = {vocab} is not a token id of the agent's "
                                                        f"vocabulary ([0, {vocab}))")
    assert "tokens[0] = -5" in (ids_problem([-5], vocab, "tokens") or "")
    assert logprobs_problem([0.0, -2.0], "lp") is None
    assert logprobs_problem([-1.0, math.nan], "lp") == "lp[1] = nan is not a log-probability (finite, <= 0)"
    assert vocab_size(str(tmp_path)) is None  # no config.json: only the contract's bound applies


async def test_buffer_rejects_an_out_of_vocabulary_sample_alone_and_abandons_its_group(
        redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = config(tmp_path, tiny_model_dir)
    bus = Bus(redis_url, "wv", "buffer-A")
    s = bus.streams
    buffer = BufferService(cfg, "A", bus)
    g1 = [Sample(**{**GOOD, "group_id": "g1", "group_samples": 3, "tokens": tokens, "reward": r})
          for tokens, r in (([5, 6, 40], 1.0), ([5, 6, 10**6], 1.0), ([5, 6, 40], 0.0))]
    g2 = [Sample(**{**GOOD, "group_id": "g2", "reward": r}) for r in (1.0, 0.0)]
    await emit(bus, *g1, *g2)  # the coordinator emitted both (a buggy environment made g1's second sample)
    await buffer.on_sample(g1[0])
    bad = g1[1]
    with pytest.raises(Reject, match=f"sample {bad.id} of group g1: tokens\\[2\\] = 1000000 is not a token id"):
        await buffer.on_sample(bad)
    events = [e for _, f in await bus.redis.xrange(s.events) for e in [decode(f[FIELD], Event)]]
    assert [(e.kind, e.group_id, e.outcome) for e in events] == [("group_done", "g1", "abandoned")]
    assert events[0].reason.startswith("dead-lettered sample: tokens[2] = 1000000")
    assert await bus.redis.zscore(s.groups_pending("A"), "g1") is None  # no timeout needed
    assert await bus.redis.hlen(s.buffer_samples("A")) == 0  # the group's stored sample is gone
    with pytest.raises(Reject):  # a redelivery: rejected again, reported once
        await buffer.on_sample(bad)
    await buffer.on_sample(g1[2])  # late member: not stored
    assert await bus.redis.hlen(s.buffer_samples("A")) == 0  # (the verdict on record is repeated, as always)
    again = [decode(f[FIELD], Event) for _, f in await bus.redis.xrange(s.events)]
    assert [(e.group_id, e.outcome, e.reason) for e in again] == [("g1", "abandoned", events[0].reason)] * 2
    for member in g2:  # other groups go on
        await buffer.on_sample(member)
    assert await bus.redis.xlen(s.batches("A")) == 1
    await bus.close()


async def test_buffer_takes_group_samples_and_membership_from_the_coordinators_record(
        redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Forged samples on the real stream, read by the buffer's real consumer loop: a group of one the coordinator
    never emitted, an intruder claiming to complete a real group alone, and a member claiming a group size of 1.
    Each is dead-lettered with its reason; the good samples of the real groups are still released."""
    cfg = config(tmp_path, tiny_model_dir)
    bus = Bus(redis_url, "wv", "buffer-A")
    s = bus.streams
    buffer = BufferService(cfg, "A", bus)
    g1 = [Sample(**{**GOOD, "group_id": "g1", "reward": r}) for r in (1.0, 0.0)]
    g2 = [Sample(**{**GOOD, "group_id": "g2", "reward": r}) for r in (1.0, 0.0)]
    forged = {"alone": Sample(**{**GOOD, "group_id": "forged", "group_samples": 1}),
              "intruder": Sample(**{**GOOD, "group_id": "g1", "group_samples": 1}),
              "member": g2[0].model_copy(update={"group_samples": 1})}
    for f in forged.values():  # ahead of the real samples
        await bus.publish(s.samples("A"), f)
    await emit(bus, *g1, *g2)
    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(s.samples("A"), "buffer", "buffer-A", buffer.on_sample, stop, block_ms=50))
    await wait_for(lambda: bus.redis.xlen(s.deadletter), 3)
    await wait_for(lambda: bus.redis.xlen(s.batches("A")), 1)
    stop.set()
    await task
    letters = {d.payload: d.reason for _, f in await bus.redis.xrange(s.deadletter)
               for d in [decode(f[FIELD], DeadLetter)]}
    reasons = {name: letters[encode(f)] for name, f in forged.items()}
    assert "the coordinator emitted no group 'forged' to agent 'A'" in reasons["alone"]
    assert "not one of the 2 samples the coordinator emitted in the group" in reasons["intruder"]
    assert "group_samples = 1 disagrees with the coordinator's record of the group (2 samples)" in reasons["member"]
    (batch,) = [decode(f[FIELD], Batch) for _, f in await bus.redis.xrange(s.batches("A"))]
    assert {x.id for x in batch.samples} == {x.id for x in g1}  # the real group went on, the intruder did not
    verdicts = {e.group_id: e.outcome for _, f in await bus.redis.xrange(s.events)
                for e in [decode(f[FIELD], Event)] if e.kind == "group_done"}
    assert verdicts == {"g1": "kept", "g2": "abandoned"}  # g2 lost a member: abandoned at once, accounted for
    await bus.close()


async def wait_for(count: Any, target: int, timeout: float = 20.0) -> None:  # noqa: ASYNC109
    deadline = asyncio.get_running_loop().time() + timeout
    while await count() < target:
        assert asyncio.get_running_loop().time() < deadline, f"still {await count()} of {target} after {timeout}s"
        await asyncio.sleep(0.05)


def engine_reply(output_ids: list[int], logprobs: list[float]) -> httpx.Response:
    pairs = [[lp, t, None] for lp, t in zip(logprobs, output_ids, strict=True)]
    meta = {"id": "r", "finish_reason": {"type": "stop"}, "prompt_tokens": 2, "completion_tokens": len(output_ids),
            "weight_version": "0", "output_token_logprobs": pairs}
    return httpx.Response(200, content=json.dumps({"text": "", "output_ids": output_ids, "meta_info": meta}))


async def test_rollout_never_passes_on_a_bad_engine_reply(redis_url: str, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    cfg = config(tmp_path, tiny_model_dir)
    bus = Bus(redis_url, "wv", "rollout-A")
    svc = RolloutService(cfg, "A", bus, "http://engine")
    vocab = svc.vocab
    assert vocab is not None
    answers = iter([engine_reply([3, vocab + 7], [-0.1, -0.2]), engine_reply([3, 4], [-0.1, math.nan]),
                    engine_reply([3, 4], [-0.1, 0.3]), engine_reply([3, 4], [-0.1, -0.2])])
    await svc.client.aclose()
    svc.client = EngineClient("http://engine", transport=httpx.MockTransport(lambda _: next(answers)))
    reply_stream = bus.streams.replies("coordinator")
    reasons = [f"output_ids[1] = {vocab + 7}", "output_logprobs[1] = nan", "output_logprobs[1] = 0.3"]
    for reason in reasons:
        req = GenerateRequest(agent="A", episode_id="e", group_id="g", turn=0, role="X", input_ids=[1, 2],
                              sampling=SamplingParams(), reply_stream=reply_stream)
        with pytest.raises(Reject, match=f"answered {req.id} wrongly: " + reason.replace("[", "\\[")):
            await svc.on_turn(req)
    await svc.on_turn(req)  # a good reply goes on
    replies = [decode(f[FIELD], GenerateReply) for _, f in await bus.redis.xrange(reply_stream)]
    assert [r.error is not None for r in replies] == [True, True, True, False]
    assert all(r.output_ids == [] for r in replies[:3]) and replies[3].output_ids == [3, 4]
    assert all(reason in (r.error or "") for reason, r in zip(reasons, replies, strict=False))
    await svc.close()
    await bus.close()
