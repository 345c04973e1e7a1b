"""Authenticated weights (real Redis, the real torch trainer on the tiny model): the checksum covers every file
of a version, the trainer signs what it publishes with the run's secret, ``refusal`` accepts exactly that and
refuses forged, uncommitted and corrupt updates; the fleet records a version only once it loaded. The secret is
never in Redis: `tandem up` makes it once per run (a 0600 file kept for --resume) and hands it by environment; a
trainer or rollout without it refuses to start naming the variable."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.common.weights_auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    MissingWeightsSecret,
    refusal,
    run_dir_secret,
    run_secret,
    secret_problem,
    sign,
    weights_checksum,
)
from services.contracts.codec import FIELD, decode
from services.contracts.config import AgentConfig, parse_config
from services.contracts.messages import Batch, DeadLetter, Sample, WeightsUpdate
from services.launcher.up import wipe_run
from services.rollout.fleet import EngineFleet
from services.rollout.service import RolloutService
from services.trainer.service import TrainerService
from services.training.backends import make_policy

REPO = Path(__file__).resolve().parents[2]


def sample(group: str, reward: float) -> Sample:
    return Sample(agent="A", role="X", episode_id="e", group_id=group, group_samples=2, tokens=[5, 6, 7, 40, 41],
                  loss_mask=[0, 0, 0, 1, 1], rollout_logprobs=[0.0, 0.0, 0.0, -3.0, -3.0], reward=reward,
                  weight_versions=[0])


def corrupt(directory: Path) -> None:
    """Flip the last byte of the version's first weights file."""
    shard = sorted(directory.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))


def test_the_checksum_covers_every_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(tiny_model_dir, copy)
    base = weights_checksum(copy)
    assert base == weights_checksum(tiny_model_dir) and len(base) == 64
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    assert weights_checksum(copy) != base
    shutil.copy(tiny_model_dir / "config.json", copy / "config.json")
    assert weights_checksum(copy) == base
    (copy / "extra.safetensors").write_bytes(b"")
    assert weights_checksum(copy) != base
    with pytest.raises(FileNotFoundError):
        weights_checksum(tmp_path / "missing")


def test_the_secret_comes_from_the_environment_never_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-the-env")
    assert run_secret() == b"from-the-env" and secret_problem() is None
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(MissingWeightsSecret, match=f"{SECRET_ENV} is not set"):
        run_secret()
    mounted = tmp_path / "weights-secret"
    monkeypatch.setenv(SECRET_FILE_ENV, str(mounted))  # a mounted secret (docker compose)
    assert secret_problem() == f"{SECRET_FILE_ENV}: cannot read {mounted}: No such file or directory"
    mounted.write_text("from-a-file\n")
    assert run_secret() == b"from-a-file"


def test_tandem_up_makes_the_secret_once_per_run_in_a_private_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV)
    cfg = parse_config({"run": {"name": "ws", "output_dir": str(tmp_path / "runs"),
                                "checkpoint_root": str(tmp_path / "ck")},
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": "m"}}})
    first = run_dir_secret(cfg.run_dir())
    path = cfg.run_dir() / "weights.secret"
    assert len(first) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    assert run_dir_secret(cfg.run_dir()) == first and stat.S_IMODE(path.stat().st_mode) == 0o600  # --resume
    wipe_run(cfg)  # --fresh
    assert run_dir_secret(cfg.run_dir()) != first
    monkeypatch.setenv(SECRET_ENV, "given")
    assert run_dir_secret(cfg.run_dir()) == "given"


VERIFY = """
import asyncio, sys
from services.common.bus import Bus
from services.common.weights_auth import refusal, run_secret
from services.contracts.messages import WeightsUpdate

async def main():
    bus = Bus(sys.argv[1], "wr", "rollout-A")
    print(await refusal(bus.redis, bus.streams, run_secret(), WeightsUpdate.model_validate_json(sys.argv[2])))
    await bus.close()

asyncio.run(main())
"""


async def test_a_resumed_run_verifies_with_the_same_secret(redis_url: str, tiny_model_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer signs in one process with the secret `tandem up` made; after a restart a new process given
    the secret read back from the run directory accepts it, and one given another run's secret refuses it."""
    monkeypatch.delenv(SECRET_ENV)
    run_dir = tmp_path / "runs" / "wr"
    monkeypatch.setenv(SECRET_ENV, run_dir_secret(run_dir))
    cfg = parse_config({"run": {"name": "wr", "checkpoint_root": str(tmp_path / "ck"), "total_steps": 2},
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir)}}})
    bus = Bus(redis_url, "wr", "trainer-A")
    trainer = TrainerService(cfg, "A", bus, await asyncio.to_thread(make_policy, cfg.agents["A"], 1.0))
    await trainer.resume()
    await trainer.on_batch(Batch(agent="A", weight_version=1, samples=[sample("g", 1.0), sample("g", 0.0)]))
    (w,) = [decode(f[FIELD], WeightsUpdate) for _, f in await bus.redis.xrange(bus.streams.weights("A"))]
    assert not [k async for k in bus.redis.scan_iter(match="*secret*")]  # nothing of it in Redis
    monkeypatch.delenv(SECRET_ENV)
    for secret, verdict in ((run_dir_secret(run_dir), "None"), (run_dir_secret(tmp_path / "other"),
                                                                "bad signature (not signed with this run's secret)")):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", VERIFY, redis_url, w.model_dump_json(), env={**os.environ, SECRET_ENV: secret},
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0 and out.decode().strip() == verdict, err.decode()[-2000:]
    await bus.close()


@pytest.mark.parametrize("service", ["trainer", "rollout"])
def test_a_trainer_or_rollout_without_the_secret_refuses_to_start(service: str, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"run": {"name": "nos"}, "redis_url": "redis://127.0.0.1:1/0",
                                "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                                "agents": {"A": {"model_path": "m"}}}))
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    done = subprocess.run([sys.executable, "-m", f"services.{service}", "--config", str(path), "--agent", "A"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{SECRET_ENV} is not set" in done.stderr, done.stderr[-2000:]


async def test_the_trainer_signs_what_it_publishes_and_only_that_passes(redis_url: str, tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    cfg = parse_config({"run": {"name": "wa", "checkpoint_root": str(tmp_path / "ck"), "total_steps": 2},
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir)}}})
    bus = Bus(redis_url, "wa", "trainer-A")
    s = bus.streams
    trainer = TrainerService(cfg, "A", bus, await asyncio.to_thread(make_policy, cfg.agents["A"], 1.0))
    await trainer.resume()
    await trainer.on_batch(Batch(agent="A", weight_version=1, samples=[sample("g", 1.0), sample("g", 0.0)]))
    (w,) = [decode(f[FIELD], WeightsUpdate) for _, f in await bus.redis.xrange(s.weights("A"))]
    secret = run_secret()
    assert w.checksum == weights_checksum(w.path)
    assert w.signature == sign(secret, "A", 1, w.path, w.checksum)
    assert await refusal(bus.redis, s, secret, w) is None

    forged = "bad signature (not signed with this run's secret)"
    assert await refusal(bus.redis, s, b"another run's secret", w) == forged
    replay = w.model_copy(update={"weight_version": 999, "path": str(tiny_model_dir),
                                  "checksum": weights_checksum(tiny_model_dir)})
    assert await refusal(bus.redis, s, secret, replay) == forged
    resigned = replay.model_copy(update={"signature": sign(secret, "A", 999, replay.path, replay.checksum)})
    assert await refusal(bus.redis, s, secret, resigned) == "version 999 is not one the trainer of 'A' committed"
    other_path = w.model_copy(update={"path": str(tiny_model_dir),
                                      "signature": sign(secret, "A", 1, str(tiny_model_dir), w.checksum)})
    assert "differs from the trainer's commit" in (await refusal(bus.redis, s, secret, other_path) or "")
    await asyncio.to_thread(corrupt, Path(w.path))
    assert "do not match the checksum" in (await refusal(bus.redis, s, secret, w) or "")
    await bus.close()


async def test_the_fleet_records_a_version_only_once_it_loaded(tiny_model_dir: Path) -> None:
    """An engine gone under a load (registered, but nothing listens on its port) is not recorded on the version:
    the fleet deregisters it, keeps the version for its rejoin, and reports no engine loaded once none rejoined
    in time (the rollout then retries the update and records nothing)."""
    fleet = EngineFleet("A", AgentConfig(model_path=str(tiny_model_dir), num_engines=1), health_timeout=2.0,
                        start_timeout=1.0)
    fleet.engines[0].registered = True
    assert await fleet.load_weights(str(tiny_model_dir), 3) == []
    assert fleet.engines[0].weight_version == 0 and not fleet.engines[0].registered
    assert fleet.latest == (str(tiny_model_dir), 3)  # what the engine loads when it rejoins
    await fleet.close()


async def test_a_forged_update_on_the_stream_is_dead_lettered_with_its_reason(redis_url: str, tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    """Through the bus, as the rollout consumes ``weights:A``: the forged update (issue 12's: version 999, the
    start model) is dead-lettered at once with its reason, acknowledged, and no version is recorded as loaded."""
    cfg = parse_config({"run": {"name": "wa", "checkpoint_root": str(tmp_path / "ck"), "total_steps": 2},
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                        "agents": {"A": {"model_path": str(tiny_model_dir)}}})
    bus = Bus(redis_url, "wa", "rollout-A")
    s = bus.streams
    rollout = RolloutService(cfg, "A", bus, "http://127.0.0.1:9")  # refused before any engine is asked
    forged = WeightsUpdate(agent="A", weight_version=999, path=str(tiny_model_dir),
                           checksum=await asyncio.to_thread(weights_checksum, tiny_model_dir), signature="0" * 64)
    await bus.publish(s.weights("A"), forged)
    stop = asyncio.Event()
    consumer = asyncio.create_task(bus.consume(s.weights("A"), "rollout", "rollout-A", rollout.on_weights, stop))
    letters: list[DeadLetter] = []
    for _ in range(100):
        letters = [decode(f[FIELD], DeadLetter) for _, f in await bus.redis.xrange(s.deadletter)]
        if letters:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await consumer
    (letter,) = letters
    assert letter.source_stream == s.weights("A")
    assert letter.reason.endswith("refused: bad signature (not signed with this run's secret)")
    assert await bus.redis.get(s.loaded_weight_version("A")) is None
    (group,) = await bus.redis.xinfo_groups(s.weights("A"))
    assert int(group["pending"]) == 0
    await rollout.close()
    await bus.close()
