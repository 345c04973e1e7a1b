"""The services' handlers, called directly (no subprocess for the service) against the real Redis fixture:
the trainer's ``on_batch``/``on_control``, the buffer's ``on_sample``, the rollout's ``on_turn``/``on_weights``
(in front of a real embedded engine behind the real SGLang router)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.buffer.service import BufferService
from services.common.admin_token import ADMIN_TOKEN_ENV
from services.common.bus import Bus, Reject
from services.common.weights_auth import run_secret, sign
from services.contracts.codec import FIELD, decode
from services.contracts.config import TandemConfig, parse_config
from services.contracts.messages import (
    Batch,
    Control,
    Event,
    GenerateReply,
    GenerateRequest,
    Sample,
    SamplingParams,
    WeightsUpdate,
)
from services.rollout.service import RolloutService
from services.trainer.service import TrainerService
from services.training.backends import Policy, make_policy
from tests.helpers import ADMIN_TOKEN, emit, engines_behind_router, make_sample
from tests.trainer_commit import commit_weights


def config(tmp_path: Path, model: Path, **agent: object) -> TandemConfig:
    return parse_config({"run": {"name": "t", "checkpoint_root": str(tmp_path / "ck"), "total_steps": 3},
                         "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                         "agents": {"A": {"model_path": str(model), **agent}}})


def sample(group: str, reward: float, size: int = 2, agent: str = "A") -> Sample:
    return make_sample(group, reward, agent=agent, size=size, tokens=[5, 6, 7, 40, 41], loss_mask=[0, 0, 0, 1, 1],
                       logprobs=[0.0, 0.0, 0.0, -3.0, -3.0])


async def entries(bus: Bus, stream: str, model: type) -> list:
    return [decode(f[FIELD], model) for _, f in await bus.redis.xrange(stream)]


async def test_trainer_handlers_train_commit_announce_once(redis_url: str, tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    cfg = config(tmp_path, tiny_model_dir)
    bus = Bus(redis_url, "t", "trainer-A")
    s = bus.streams
    policy = await asyncio.to_thread(make_policy, cfg.agents["A"], 1.0)
    assert isinstance(policy, Policy) and not policy.follower
    trainer = TrainerService(cfg, "A", bus, policy)
    await trainer.resume()
    assert trainer.weight_version == 0 and (trainer.state_root / "v00000").is_dir()

    batch = Batch(agent="A", weight_version=1, samples=[sample("g", 1.0), sample("g", 0.0)])
    await trainer.on_batch(batch)
    assert trainer.weight_version == 1 and policy.weight_version == 1
    assert int(await bus.redis.get(s.published_weight_version("A"))) == 1
    assert await bus.redis.smismember(s.trained_samples("A"), [x.id for x in batch.samples]) == [1, 1]
    log = [json.loads(r) for r in await bus.redis.lrange(s.train_log("A"), 0, -1)]
    assert [r["batch_id"] for r in log] == [batch.id]
    (weights,) = await entries(bus, s.weights("A"), WeightsUpdate)
    assert weights.weight_version == 1 and await asyncio.to_thread(Path(weights.path, "model.safetensors").is_file)
    steps = [e for e in await entries(bus, s.events, Event) if e.kind == "train_step"]
    assert [e.weight_version for e in steps] == [1] and steps[0].batch_weight_version == 1
    assert steps[0].metrics["samples"] == 2
    m = steps[0].metrics  # the step's heap trimmed (other threads may allocate between the two readings)
    assert 0 < m["rss_trimmed_mb"] <= m["rss_mb"] + 16

    await trainer.on_batch(batch)  # a redelivery: not trained again, the version is announced again
    assert trainer.weight_version == 1 and await bus.redis.llen(s.train_log("A")) == 1
    assert [w.weight_version for w in await entries(bus, s.weights("A"), WeightsUpdate)] == [1, 1]

    with pytest.raises(Reject, match="samples of \\['B'\\]"):
        await trainer.on_batch(Batch(agent="A", weight_version=2, samples=[sample("h", 1.0, agent="B")]))
    shutil.rmtree(trainer.state_dir(1))
    await trainer.on_control(Control(command="checkpoint"))  # re-writes the current version's state
    assert trainer.state_dir(1).is_dir()

    again = TrainerService(cfg, "A", bus, await asyncio.to_thread(make_policy, cfg.agents["A"], 1.0))
    await again.resume()  # a restart resumes at the published version
    assert again.weight_version == 1 and again.policy.weight_version == 1
    shutil.rmtree(again.state_dir(1))
    with pytest.raises(RuntimeError, match="version 1 is published but its training state"):
        await again.resume()
    await bus.close()


async def test_buffer_handler_reports_the_verdict_and_releases_the_batch(redis_url: str, tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    cfg = config(tmp_path, tiny_model_dir, groups_per_batch=1, filter_zero_variance=True)
    bus = Bus(redis_url, "t", "buffer-A")
    buffer = BufferService(cfg, "A", bus)
    g1, g2 = [sample("g1", 1.0), sample("g1", 0.0)], [sample("g2", 1.0), sample("g2", 1.0)]
    await emit(bus, *g1, *g2)
    await buffer.on_sample(g1[0])
    assert await entries(bus, bus.streams.events, Event) == []
    await buffer.on_sample(g1[1])
    await buffer.on_sample(g2[0])
    await buffer.on_sample(g2[1])  # zero variance: dropped
    with pytest.raises(Reject, match="sample of agent 'B' reached the buffer of 'A'"):
        await buffer.on_sample(sample("g3", 1.0, agent="B"))
    (batch,) = await entries(bus, bus.streams.batches("A"), Batch)
    assert batch.weight_version == 1 and {x.group_id for x in batch.samples} == {"g1"}
    events = [e.model_dump(exclude={"id", "created_at", "schema_version"})
              for e in await entries(bus, bus.streams.events, Event)]
    assert events == [{"kind": "group_done", "source": "buffer-A", "agent": "A", "group_id": "g1", "outcome": "kept",
                       "reason": None, "was_kept": False},
                      {"kind": "batch_released", "source": "buffer-A", "agent": "A", "weight_version": 1, "samples": 2},
                      {"kind": "group_done", "source": "buffer-A", "agent": "A", "group_id": "g2",
                       "outcome": "dropped", "reason": "zero reward variance", "was_kept": False}]
    await bus.close()


@pytest.fixture(scope="module")
def router(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """One real embedded engine behind the real SGLang router: (router URL, engine URL)."""
    with engines_behind_router(tiny_model_dir, tmp_path_factory.mktemp("svc-router"), ["A-0"]) as (router_url, urls):
        yield router_url, urls[0]


async def test_rollout_handlers_answer_turns_and_load_weights(redis_url: str, tiny_model_dir: Path,
                                                              tmp_path: Path, router: tuple[str, str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN_TOKEN)  # an external router: the rollout takes the run's token
    router_url, engine_url = router
    cfg = config(tmp_path, tiny_model_dir)
    bus = Bus(redis_url, "t", "rollout-A")
    s = bus.streams
    rollout = await RolloutService.start(cfg, "A", bus, router_url)
    try:
        req = GenerateRequest(agent="A", episode_id="e", group_id="g", turn=0, role="X", input_ids=[5, 6, 7],
                              sampling=SamplingParams(max_new_tokens=4, seed=1), reply_stream=s.replies("test"))
        await rollout.on_turn(req)
        (reply,) = await entries(bus, s.replies("test"), GenerateReply)
        assert reply.request_id == req.id and reply.error is None and 1 <= len(reply.output_ids) <= 4
        assert reply.weight_version == 0 and len(reply.output_logprobs) == len(reply.output_ids)
        with pytest.raises(Reject, match="request for agent 'B'"):
            await rollout.on_turn(req.model_copy(update={"agent": "B"}))
        with pytest.raises(Reject, match="reply_stream 'tandem:other:replies:c'.*not a stream of run 't'"):
            await rollout.on_turn(req.model_copy(update={"reply_stream": "tandem:other:replies:c"}))

        await commit_weights(bus, "A", 1, tiny_model_dir)
        v2 = await commit_weights(bus, "A", 2, tiny_model_dir)
        await rollout.on_weights(v2)
        assert int(await bus.redis.get(s.loaded_weight_version("A"))) == 2
        assert WeightsUpdate.model_validate_json(await bus.redis.get(s.loaded_weights("A"))) == v2
        with pytest.raises(Reject, match="version 1 is older than the loaded version 2"):  # never rolls back
            await rollout.on_weights(v2.model_copy(update={"weight_version": 1}))
        assert int(await bus.redis.get(s.loaded_weight_version("A"))) == 2
        loaded = [e for e in await entries(bus, s.events, Event) if e.kind == "weights_loaded"]
        assert [(e.weight_version, e.engines, e.path) for e in loaded] == [(2, [engine_url], str(tiny_model_dir))]
        await rollout.on_turn(req.model_copy(update={"id": "second"}))
        assert (await entries(bus, s.replies("test"), GenerateReply))[-1].weight_version == 2

        await rollout.publish_load()
        (load,) = [e for e in await entries(bus, s.events, Event) if e.kind == "rollout_load"]
        assert load.report() == {"queue_depth": 0, "inflight": 0, "capacity": rollout.concurrency, "waiting": 0,
                                 "router": router_url, "router_restarts": 0,
                                 "engines": [{"url": engine_url, "healthy": True}]}
    finally:
        await rollout.close()
        await bus.close()


async def test_rollout_loads_only_authentic_weights(redis_url: str, tiny_model_dir: Path, tmp_path: Path,
                                                    router: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged (unsigned, wrongly signed, uncommitted) or corrupt update is rejected with its reason and the
    engine keeps the weights it had; the committed, signed version is loaded."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
    router_url, engine_url = router
    cfg = config(tmp_path, tiny_model_dir)
    bus = Bus(redis_url, "t", "rollout-A")
    s = bus.streams
    v1 = tmp_path / "v1"
    shutil.copytree(tiny_model_dir, v1)
    rollout = await RolloutService.start(cfg, "A", bus, router_url)
    async with httpx.AsyncClient(timeout=5) as http:
        before = (await http.get(f"{engine_url}/get_model_info")).json()["weight_version"]  # the engine's, as is
    try:
        good = await commit_weights(bus, "A", 1, v1)
        start = {"weight_version": 999, "path": str(tiny_model_dir)}  # the forged update of issue 12: the start model
        forged = {"not signed": good.model_copy(update={**start, "signature": ""}),
                  "bad signature": good.model_copy(update=start),
                  "version 2 is not one the trainer of 'A' committed": WeightsUpdate(  # signed, never committed
                      agent="A", weight_version=2, path=good.path, checksum=good.checksum,
                      signature=sign(run_secret(), "A", 2, good.path, good.checksum))}
        for reason, w in forged.items():
            with pytest.raises(Reject, match=f"weights version {w.weight_version} at .* refused: {reason}"):
                await rollout.on_weights(w)
        cfg_file = v1 / "config.json"
        original = cfg_file.read_bytes()
        cfg_file.write_bytes(original + b" ")  # corrupt after the commit
        with pytest.raises(Reject, match="do not match the checksum"):
            await rollout.on_weights(good)
        assert await bus.redis.get(s.loaded_weight_version("A")) is None
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"{engine_url}/get_model_info")).json()["weight_version"] == before != "1"
        cfg_file.write_bytes(original)
        await rollout.on_weights(good)
        assert int(await bus.redis.get(s.loaded_weight_version("A"))) == 1
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"{engine_url}/get_model_info")).json()["weight_version"] == "1"
    finally:
        await rollout.close()
        await bus.close()
