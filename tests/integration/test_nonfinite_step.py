"""A non-finite training step is skipped, never published (real torch model on the tiny demo model, real Redis).

The step raises ``NonFiniteStep`` before any optimizer step on a NaN loss or gradient; the trainer service
rolls back, publishes nothing, reports ``train_step_skipped``, counts the buffer's released batch back down,
marks the groups dropped, dead-letters the batch naming its samples (``Reject``) and stops after
``max_nonfinite_steps`` in a row. The coordinator replaces the batch's groups.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.common.bus import Bus, Reject
from services.contracts.codec import FIELD, decode
from services.contracts.config import AgentConfig, AlgorithmConfig, TandemConfig, parse_config
from services.contracts.messages import Batch, Event, Sample, TrainStepSkipped, WeightsUpdate
from services.coordinator.scheduler import Coordinator
from services.trainer.service import TrainerService
from services.training.backends import make_policy
from services.training.step import NonFiniteStep


def config(tmp_path: Path, model: Path, redis_url: str, **agent: object) -> TandemConfig:
    return parse_config({"run": {"name": "nf", "checkpoint_root": str(tmp_path / "ck"), "total_steps": 3,
                                 "output_dir": str(tmp_path / "runs")},
                         "redis_url": redis_url,
                         "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                         "agents": {"A": {"model_path": str(model), "groups_per_batch": 1, **agent}}})


def sample(group: str, reward: float, nan: bool = False) -> Sample:
    s = Sample(agent="A", role="X", episode_id="e", group_id=group, group_samples=2, tokens=[5, 6, 7, 40, 41],
               loss_mask=[0, 0, 0, 1, 1], rollout_logprobs=[0.0, 0.0, 0.0, -3.0, -3.0], reward=reward,
               weight_versions=[0])
    if nan:  # past the contract (model_copy does not validate): what a buggy producer could still hand over
        s = s.model_copy(update={"rollout_logprobs": [0.0, 0.0, 0.0, -3.0, math.nan]})
    return s


def weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.trainable]


def test_the_step_refuses_a_nan_logprob_and_leaves_the_weights(tiny_model_dir: Path) -> None:
    policy = make_policy(AgentConfig(model_path=str(tiny_model_dir), algorithm=AlgorithmConfig(lr=1e-2)), 1.0)
    before = weights(policy)
    with pytest.raises(NonFiniteStep, match="non-finite"):
        policy.train_step([sample("g", 1.0), sample("g", 0.0, nan=True)])
    assert policy.weight_version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, weights(policy), strict=True))


def test_the_step_refuses_an_inf_weight(tiny_model_dir: Path) -> None:
    policy = make_policy(AgentConfig(model_path=str(tiny_model_dir), algorithm=AlgorithmConfig(lr=1e-2)), 1.0)
    with torch.no_grad():
        policy.trainable[0].view(-1)[0] = math.inf
    with pytest.raises(NonFiniteStep, match="non-finite"):
        policy.train_step([sample("g", 1.0), sample("g", 0.0)])
    assert policy.weight_version == 0


async def entries(bus: Bus, stream: str, model: type) -> list:
    return [decode(f[FIELD], model) for _, f in await bus.redis.xrange(stream)]


async def test_the_trainer_skips_reports_and_stops_after_the_limit(redis_url: str, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    # two minibatches: the first (good) steps the optimizer, the second (NaN) is caught; the rollback undoes both
    cfg = config(tmp_path, tiny_model_dir, redis_url, max_nonfinite_steps=2,
                 algorithm={"lr": 1e-2, "minibatches": 2})
    bus = Bus(redis_url, "nf", "trainer-A")
    s = bus.streams
    policy = await asyncio.to_thread(make_policy, cfg.agents["A"], 1.0)
    trainer = TrainerService(cfg, "A", bus, policy)
    await trainer.resume()
    before = weights(policy)
    await bus.redis.set(s.batches_released("A"), 1)  # the buffer released the batch
    await bus.redis.hset(s.buffer_verdicts("A"), mapping={"g1": "kept", "g2": "kept"})
    bad = Batch(agent="A", weight_version=1, samples=[sample("g1", 1.0), sample("g1", 0.0), sample("g2", 1.0),
                                            sample("g2", 0.0, nan=True)])
    ids = [x.id for x in bad.samples]
    with pytest.raises(Reject, match=f"rejected samples: {', '.join(ids)}"):
        await trainer.on_batch(bad)
    assert trainer.weight_version == 0 and policy.weight_version == 0 and trainer.nonfinite_in_row == 1
    assert all(torch.equal(a, b) for a, b in zip(before, weights(policy), strict=True))
    assert await entries(bus, s.weights("A"), WeightsUpdate) == []
    assert await bus.redis.get(s.published_weight_version("A")) is None
    assert int(await bus.redis.get(s.batches_released("A"))) == 0  # the buffer releases a batch in its place
    assert await bus.redis.hgetall(s.buffer_verdicts("A")) == {b"g1": b"dropped:non-finite training step",
                                                                b"g2": b"dropped:non-finite training step"}
    (skip,) = [e for e in await entries(bus, s.events, Event) if e.kind == "train_step_skipped"]
    assert isinstance(skip, TrainStepSkipped)
    assert skip.sample_ids == ids and skip.group_ids == ["g1", "g2"] and skip.batch_id == bad.id
    assert skip.consecutive == 1 and "non-finite" in skip.reason

    with pytest.raises(Reject, match="rejected samples"):  # a redelivery: recorded once, not trained again
        await trainer.on_batch(bad)
    assert trainer.nonfinite_in_row == 1 and int(await bus.redis.get(s.batches_released("A"))) == 0
    assert int(await bus.redis.get(s.nonfinite_in_row("A"))) == 1

    good = Batch(agent="A", weight_version=1, samples=[sample("g3", 1.0), sample("g3", 0.0)])
    await trainer.on_batch(good)  # trains from the restored weights; the count of skips in a row resets
    assert trainer.weight_version == 1 and trainer.nonfinite_in_row == 0
    assert int(await bus.redis.get(s.nonfinite_in_row("A"))) == 0
    (pub,) = await entries(bus, s.weights("A"), WeightsUpdate)
    tensors = await asyncio.to_thread(load_file, str(Path(pub.path) / "model.safetensors"))
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors.values())

    for n in (1, 2):
        with pytest.raises(Reject):
            await trainer.on_batch(Batch(agent="A", weight_version=2, samples=[sample(f"h{n}", 1.0),
                                                                     sample(f"h{n}", 0.0, nan=True)]))
    assert trainer.nonfinite_in_row == 2 and trainer.stop.is_set()
    assert trainer.failed is not None and "2 training steps in a row" in trainer.failed
    assert "max_nonfinite_steps = 2" in trainer.failed
    assert [w.weight_version for w in await entries(bus, s.weights("A"), WeightsUpdate)] == [1]
    restarted = TrainerService(cfg, "A", bus, policy)  # a restart keeps the count: it refuses to go on
    with pytest.raises(RuntimeError, match="stopped after 2 non-finite training steps in a row"):
        await restarted.resume()
    await bus.close()


async def test_the_coordinator_replaces_the_groups_of_a_skipped_step(redis_url: str, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    cfg = config(tmp_path, tiny_model_dir, redis_url)
    coord = Coordinator(cfg, Bus(redis_url, "nf", "coordinator"))
    await coord.restore()
    agent = coord.state.agents["A"]
    agent.in_flight_groups = 1
    agent.resolve_group("g1", "kept")
    assert agent.kept_groups == 1 and agent.claimed == 1
    ev = TrainStepSkipped(source="trainer-A", agent="A", batch_id="b", batch_weight_version=1, reason="non-finite loss",
                          sample_ids=["s1", "s2"], group_ids=["g1"], consecutive=1)
    with pytest.raises(Reject, match="the trainer recorded no such skip"):  # an event is no fact
        await coord.events.on_event(ev)
    assert agent.kept_groups == 1 and agent.skipped_steps == 0
    await coord.bus.redis.hset(coord.bus.streams.skipped_batches("A"), "b", "{}")  # the trainer's record of it
    for _ in range(2):  # a re-sent event counts once
        await coord.events.on_event(ev)
    assert agent.kept_groups == 0 and agent.dropped_groups == 1 and agent.skipped_steps == 1
    assert agent.claimed == 0 and agent.wants_groups()
    assert json.loads(json.dumps(coord.state.status()))["agents"]["A"]["skipped_steps"] == 1
    await coord.bus.close()
