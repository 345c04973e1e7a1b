"""Two agents on one engine fleet (``agents.B.share_engines_with: A``), with real Redis, the real SGLang router and
a real embedded engine process: B's rollout drives A's router, each agent's turns name and record its own
adapter version, A's new versions leave B's replies as they were, and an engine the fleet restarts gets both
agents' kept adapters back before it takes turns. The config check names the field for every shape that
cannot share."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.common.admin_token import ADMIN_TOKEN_ENV
from services.common.bus import Bus
from services.common.embedded_redis import free_port
from services.contracts.codec import FIELD, decode
from services.contracts.config import ConfigError, parse_config
from services.contracts.messages import GenerateReply, GenerateRequest, SamplingParams
from services.rollout.adapters import read_kept
from services.rollout.service import RolloutService
from tests.helpers import ADMIN_TOKEN, engine_killed_and_back
from tests.integration.test_adapter_sync import merged_logprobs
from tests.trainer_commit import commit_weights
from tests.unit.test_lora_adapters import LORA, batch, trained

PROMPT = [5, 6, 7, 8]


def shared_config(model: str, **b: Any) -> dict[str, Any]:
    lora = LORA.model_dump()
    return {"run": {"name": "shared", "total_steps": 3},
            "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
            "agents": {"A": {"model_path": model, "lora": lora, "router_port": free_port()},
                       "B": {"model_path": model, "lora": lora, "share_engines_with": "A", **b}}}


@pytest.mark.parametrize(("b", "a", "why"), [
    ({"share_engines_with": "B"}, {}, "cannot share its own engines"),
    ({"share_engines_with": "C"}, {}, "names agent 'C'"),
    ({}, {"share_engines_with": "B"}, "(no chains)"),  # a cycle
    ({"model_path": "/elsewhere"}, {}, "differs from 'A'"),
    ({"lora": None}, {}, "must train with lora"),
    ({"engine": "sglang"}, {}, "engine 'sglang' differs"),
])
def test_a_bad_share_engines_with_is_refused_naming_the_field(b: dict, a: dict, why: str) -> None:
    data = shared_config("/models/tiny", **b)
    data["agents"]["A"].update(a)
    with pytest.raises(ConfigError, match="share_engines_with") as err:
        parse_config(data)
    assert why in str(err.value)


def test_a_good_share_engines_with_loads() -> None:
    cfg = parse_config(shared_config("/models/tiny"))
    assert cfg.agents["B"].share_engines_with == "A" and cfg.agents["A"].share_engines_with is None


@pytest.fixture(scope="module")
def versions(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A's versions 1 and 2, B's version 1 (trained differently), as their trainers publish them."""
    root = tmp_path_factory.mktemp("shared")
    a, b = trained(tiny_model_dir, 1), trained(tiny_model_dir, 2, flip=True)
    out = {"A1": a.save(root / "A" / "v00001")[0], "B1": b.save(root / "B" / "v00001")[0]}
    a.train_step(batch())
    out["A2"] = a.save(root / "A" / "v00002")[0]
    return out


@pytest.fixture
async def rollouts(redis_url: str, tiny_model_dir: Path,
                   monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict[str, RolloutService]]:
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN_TOKEN)  # tandem up gives the fleet and both rollouts one token
    cfg = parse_config(shared_config(str(tiny_model_dir)))
    buses = {a: Bus(redis_url, "shared", f"rollout-{a}") for a in ("A", "B")}
    started: dict[str, RolloutService] = {}
    try:
        for agent in ("A", "B"):  # A's rollout starts the fleet; B's finds A's router on its configured port
            started[agent] = await RolloutService.start(cfg, agent, buses[agent], None)
        yield started
    finally:
        for service in reversed(started.values()):
            await service.close()
        await buses["A"].redis.flushdb()
        for bus in buses.values():
            await bus.close()


async def turn(r: RolloutService, rid: str) -> GenerateReply:
    s = r.bus.streams
    req = GenerateRequest(id=rid, agent=r.agent, episode_id="e", group_id="g", turn=0, role="X", input_ids=PROMPT,
                          sampling=SamplingParams(max_new_tokens=4, temperature=0.0), reply_stream=s.replies("t"))
    await r.on_turn(req)
    replies = [decode(f[FIELD], GenerateReply) for _, f in await r.bus.redis.xrange(s.replies("t"))]
    return next(x for x in replies if x.request_id == rid)


async def test_two_agents_share_one_fleet_and_a_restarted_engine_serves_both(
        rollouts: dict[str, RolloutService], versions: dict[str, Path]) -> None:
    a, b = rollouts["A"], rollouts["B"]
    fleet = a.fleet
    assert fleet is not None and b.fleet is None and b.router_url == fleet.router_url  # one fleet
    await a.on_weights(await commit_weights(a.bus, "A", 1, versions["A1"]))
    await b.on_weights(await commit_weights(b.bus, "B", 1, versions["B1"]))
    b1 = await turn(b, "b1")
    assert (b1.weight_version, b1.engine, b1.error) == (1, "A-0", None)
    assert b1.output_logprobs == pytest.approx(await merged_logprobs(versions["B1"]), abs=1e-4)
    await a.on_weights(await commit_weights(a.bus, "A", 2, versions["A2"]))
    a2 = await turn(a, "a2")
    assert (a2.weight_version, a2.engine) == (2, "A-0")
    assert a2.output_logprobs == pytest.approx(await merged_logprobs(versions["A2"]), abs=1e-4)
    after = await turn(b, "b1-after-A2")  # A's training leaves B's replies as they were
    assert after.weight_version == 1 and after.output_logprobs == pytest.approx(b1.output_logprobs, abs=1e-6)
    for agent, version in (("A", 2), ("B", 1)):
        assert int(await a.bus.redis.get(a.bus.streams.loaded_weight_version(agent))) == version
    assert [s.name for s in await read_kept(a.bus.redis, a.bus.streams, ["B"])] == ["B-v1"]

    async with engine_killed_and_back(fleet) as e:
        assert e.restarts == 1 and e.registered and e.adapters == {"A-v1", "A-v2", "B-v1"}
        back = await turn(b, "b1-after-restart")
        assert back.weight_version == 1 and back.output_logprobs == pytest.approx(b1.output_logprobs, abs=1e-4)
        assert (await turn(a, "a2-after-restart")).output_logprobs == pytest.approx(a2.output_logprobs, abs=1e-4)
