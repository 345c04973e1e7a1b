"""Adapter sync through the rollout (real Redis, the real SGLang router, a real embedded engine process): a
committed LoRA version loads on the resident base, turns name it (``lora_path``) and record exactly its
version; two versions stay loaded; forged, replayed or corrupt adapters are refused as forged weights are; a
restarted engine gets the kept adapters back before it takes turns."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.common.bus import Bus, Reject
from services.common.weights_auth import sign
from services.contracts.codec import FIELD, decode
from services.contracts.config import parse_config
from services.contracts.messages import GenerateReply, GenerateRequest, SamplingParams
from services.inference.generator import Engine, GenRequest
from services.rollout.fleet import EngineFleet
from services.rollout.service import RolloutService
from tests.helpers import engine_killed_and_back
from tests.trainer_commit import commit_weights
from tests.unit.test_lora_adapters import LORA, batch, trained

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def versions(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Agent A's adapter versions 1..4, as its trainer publishes them."""
    root = tmp_path_factory.mktemp("sync")
    p = trained(tiny_model_dir, 3)
    out = []
    for v in range(1, 5):
        out.append(p.save(root / f"v{v:05d}")[0])
        p.train_step(batch())
    return out


@pytest.fixture
async def rollout(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[RolloutService]:
    cfg = parse_config({"run": {"name": "ads", "checkpoint_root": str(tmp_path / "ck"), "total_steps": 3},
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir), "lora": LORA.model_dump()}}})
    bus = Bus(redis_url, "ads", "rollout-A")
    fleet = EngineFleet("A", cfg.agents["A"], interval=0.3)
    service = None
    try:
        await fleet.start()
        service = RolloutService(cfg, "A", bus, fleet.router_url, fleet)
        yield service
    finally:
        await (service.close() if service is not None else fleet.close())
        await bus.redis.flushdb()
        await bus.close()


async def turn(r: RolloutService, rid: str) -> GenerateReply:
    s = r.bus.streams
    req = GenerateRequest(id=rid, agent="A", episode_id="e", group_id="g", turn=0, role="X", input_ids=PROMPT,
                          sampling=SamplingParams(max_new_tokens=4, temperature=0.0), reply_stream=s.replies("t"))
    await r.on_turn(req)
    replies = [decode(f[FIELD], GenerateReply) for _, f in await r.bus.redis.xrange(s.replies("t"))]
    return next(x for x in replies if x.request_id == rid)


async def merged_logprobs(path: Path) -> list[float]:
    engine = Engine(path)
    try:
        out = await engine.generate(GenRequest(rid="m", input_ids=PROMPT, temperature=0.0, max_new_tokens=4))
    finally:
        engine.stop()
    return out.logprobs


async def test_adapter_versions_load_on_the_base_and_turns_record_them(rollout: RolloutService,
                                                                       versions: list[Path]) -> None:
    bus, fleet = rollout.bus, rollout.fleet
    assert fleet is not None
    base = await turn(rollout, "t0")
    assert base.weight_version == 0
    v1 = await commit_weights(bus, "A", 1, versions[0])
    await rollout.on_weights(v1)
    one = await turn(rollout, "t1")
    assert one.weight_version == 1 and one.error is None
    assert one.output_logprobs == pytest.approx(await merged_logprobs(versions[0]), abs=1e-4)
    assert one.output_logprobs != pytest.approx(base.output_logprobs, abs=1e-4)
    for v in (2, 3):
        await rollout.on_weights(await commit_weights(bus, "A", v, versions[v - 1]))
    assert fleet.engines[0].adapters == {"A-v2", "A-v3"} and fleet.sync.serving().version == 3
    assert (await turn(rollout, "t3")).weight_version == 3
    assert int(await bus.redis.get(bus.streams.loaded_weight_version("A"))) == 3

    with pytest.raises(Reject, match="older than the loaded version 3"):  # a replayed old adapter
        await rollout.on_weights(v1.model_copy(update={"weight_version": 2}))
    v4 = await commit_weights(bus, "A", 4, versions[3])
    with pytest.raises(Reject, match="bad signature"):  # a forged one: signed with another secret
        await rollout.on_weights(v4.model_copy(update={"signature": sign(b"not the run's", "A", 4, v4.path,
                                                                              v4.checksum)}))
    weights = versions[3] / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    try:
        with pytest.raises(Reject, match="do not match the checksum"):  # replaced on disk after the commit
            await rollout.on_weights(v4)
    finally:
        raw[-1] ^= 0xFF
        weights.write_bytes(bytes(raw))
    assert fleet.sync.serving().version == 3 and fleet.engines[0].adapters == {"A-v2", "A-v3"}


async def test_a_restarted_engine_gets_the_kept_adapters_back(rollout: RolloutService, versions: list[Path]) -> None:
    fleet = rollout.fleet
    assert fleet is not None
    for v in (1, 2):
        await rollout.on_weights(await commit_weights(rollout.bus, "A", v, versions[v - 1]))
    async with engine_killed_and_back(fleet) as e:
        assert e.restarts == 1 and e.registered and e.adapters == {"A-v1", "A-v2"}
        reply = await turn(rollout, "after-restart")
        assert reply.weight_version == 2
        assert reply.output_logprobs == pytest.approx(await merged_logprobs(versions[1]), abs=1e-4)
