"""Events notify, owners' records decide (services/coordinator/facts.py); an engine loads only committed weights
(services/common/weights_auth.py ``load_refusal``), whatever token its caller holds.

Real Redis, the real bus consume loop, the real coordinator class and the real embedded engine app."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

from services.common.bus import Bus
from services.common.weights_auth import run_secret
from services.contracts.codec import FIELD, decode
from services.contracts.config import parse_config
from services.contracts.messages import DeadLetter, TrainStep, WeightsLoaded
from services.coordinator.scheduler import Coordinator
from tests.helpers import ADMIN, asgi_client, commit_version, engine_app, signed_proof

STEP = {"loss": 0.5, "reward_mean": 0.25}


async def dead_letters(bus: Bus, n: int) -> list[DeadLetter]:
    letters: list[DeadLetter] = []
    for _ in range(200):
        letters = [decode(f[FIELD], DeadLetter) for _, f in await bus.redis.xrange(bus.streams.deadletter)]
        if len(letters) >= n:
            break
        await asyncio.sleep(0.05)
    return letters


async def test_forged_weights_loaded_and_train_step_events_are_dead_lettered(redis_url: str, tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """The forgery issue 33 found (one XADD of ``weights_loaded`` version 999 ended A's training early) moves
    nothing: the coordinator takes versions and metrics from the rollout's key and the trainer's log only."""
    cfg = parse_config({"run": {"name": "tb", "total_steps": 3, "output_dir": str(tmp_path / "runs")},
                        "redis_url": redis_url, "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir)}}})
    coord = Coordinator(cfg, Bus(redis_url, "tb", "coordinator"))
    await coord.restore()
    hostile = Bus(redis_url, "tb", "rollout-A")
    s = hostile.streams
    await commit_version(hostile, "A", 1, metrics=STEP, loaded=True)  # the genuine version 1
    events = [WeightsLoaded(source="rollout-A", agent="A", weight_version=999, path=str(tmp_path), engines=[]),
              TrainStep(source="trainer-A", agent="A", weight_version=7, batch_weight_version=6, metrics={"loss": 9.0}),
              WeightsLoaded(source="rollout-A", agent="A", weight_version=1, path="/elsewhere", engines=[]),
              TrainStep(source="trainer-A", agent="A", weight_version=1, batch_weight_version=1, metrics={"loss": 9.0})]
    for ev in events:
        await hostile.publish(s.events, ev)
    stop = asyncio.Event()
    consumer = asyncio.create_task(coord.bus.consume(s.events, "coordinator", "coordinator", coord.events.on_event,
                                                     stop))
    letters = await dead_letters(hostile, 2)
    for _ in range(100):  # the genuine two are taken after the forged ones
        if coord.state.agents["A"].train_steps:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await consumer
    reasons = sorted(letter.reason for letter in letters)
    assert len(reasons) == 2, reasons
    assert "version 7" in reasons[0] and "never committed" in reasons[0]
    assert "version 999" in reasons[1] and "its loaded version is 1" in reasons[1]
    a = coord.state.agents["A"]
    assert a.loaded_weight_version == 1 and not a.finished  # not ended early
    assert [t["weight_version"] for t in a.train_steps] == [1]
    assert a.train_steps[0]["loss"] == 0.5  # the committed record's metrics, not the event's 9.0
    assert coord.players.version_paths["A"][1] == "/ckpt/A/v1" and "/elsewhere" not in coord.players.pool_paths["A"]
    (group,) = await hostile.redis.xinfo_groups(s.events)
    assert int(group["pending"]) == 0
    await coord.bus.close()
    await hostile.close()


async def test_an_engine_loads_only_what_its_trainer_signed_whatever_token_the_caller_holds(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 33's bypass: the admin token alone loaded an uncommitted directory as version 999. Now the engine of
    agent A checks the trainer's signature and the files' checksum itself (403, the live model kept)."""
    copy = tmp_path / "uncommitted"
    shutil.copytree(tiny_model_dir, copy)
    secret = run_secret()
    url = "/update_weights_from_disk"
    with engine_app(tiny_model_dir, weights_secret=secret, agent="A") as app:
        async with asgi_client(app) as client:
            async def load(version: int, headers: dict[str, str]) -> httpx.Response:
                return await client.post(url, json={"model_path": str(copy), "weight_version": str(version)},
                                         headers={**ADMIN, **headers})

            bare = await load(999, {})
            assert bare.status_code == 403 and not bare.json()["success"]
            assert "no weights signature" in bare.json()["message"]
            good = signed_proof(copy, "A", 1)
            other_agent = signed_proof(copy, "B", 1)
            assert "bad signature" in (await load(1, other_agent.headers())).json()["message"]
            assert "bad signature" in (await load(999, good.headers())).json()["message"]  # not version 999
            (copy / "config.json").write_text((copy / "config.json").read_text() + " ")  # replaced after signing
            swapped = await load(1, good.headers())
            assert swapped.status_code == 403 and "do not match the signed checksum" in swapped.json()["message"]
            assert (await client.get("/get_weight_version")).json()["weight_version"] == "0"  # nothing loaded
            fresh = signed_proof(copy, "A", 1)
            ok = await load(1, fresh.headers())
            assert ok.status_code == 200 and ok.json()["success"], ok.text
            assert (await client.get("/get_weight_version")).json()["weight_version"] == "1"


def test_the_rollout_starts_its_engines_bound_to_their_agent() -> None:
    from services.contracts.config import AgentConfig
    from services.rollout.commands import engine_command

    cmd = engine_command(AgentConfig(model_path="m"), "B", 0, 9000)
    assert cmd[cmd.index("--agent") + 1] == "B"


@pytest.mark.integration  # the real sglang-router process
async def test_the_router_gets_its_keys_from_the_environment_not_the_command_line() -> None:
    """The real sglang-router through our wrapper: no key in its process's command line (readable by every local
    user), and still its worker admin API and data plane refuse a caller without the run's token."""
    from services.common.admin_token import new_token
    from services.common.embedded_redis import free_port
    from services.common.sglang_router import list_workers, router_command, wait_healthy
    from services.rollout.spawn import spawn

    token, port = new_token(), free_port()
    proc = spawn(router_command(port, [], admin_token=token), token)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, timeout=60)
        cmdline = await asyncio.to_thread(Path(f"/proc/{proc.pid}/cmdline").read_bytes)
        assert token.encode() not in cmdline and b"--admin-token-from-env" in cmdline
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(f"{url}/workers")).status_code == 401
            assert (await client.post(f"{url}/generate", json={"input_ids": [1]})).status_code == 401
        assert await list_workers(url, token=token) == []
    finally:
        proc.kill()
        await proc.wait()
