"""Bounded state (issue 12, docs/architecture.md §10): the trainer's log and trained-sample set, the group ledger
and the buffer's verdicts are pruned, against the real Redis fixture and a real tiny model, and every prune
survives a restart or a replay: nothing acknowledged is lost, nothing is trained twice.

* trainer: older log records move to ``train_log.jsonl`` with their trained-sample ids; a restarted trainer
  (fresh process state, same Redis and disk) refuses the redelivered newest batch, keeps training, and the
  coordinator's record and the weights check still see every version they need;
* the spill's crash windows: after the archive append and before the Redis trim (a record archived twice is
  read once), and a torn archive line (cut, never merged with the next record);
* ledger: only final, old enough groups leave (a kept group still in the ready queue, an undecided one and a
  recent one stay); a restart's ``outcomes`` still counts every group; a sample of a pruned group replayed
  to the buffer is refused, not stored; a verdict the buffer changed under the prune is kept;
* training-play counts: old versions move to ``train_play.jsonl``; a late episode, a crash after the move
  and a crash after the append are each counted once.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.buffer.service import BufferService
from services.common.bus import Bus, Reject
from services.common.history import TrainLogSpill, append_jsonl, read_jsonl, read_train_log, train_log_archive
from services.common.weights_auth import committed
from services.contracts.config import TandemConfig, parse_config
from services.contracts.messages import Batch, Sample
from services.coordinator import play_archive, train_play
from services.coordinator.ledger import GroupLedger, horizons
from services.coordinator.record import RunRecord
from services.coordinator.train_play import PlayCounts
from services.trainer.service import TrainerService
from services.training.backends import make_policy
from tests.helpers import emit, make_sample


def config(tmp_path: Path, model: Path, run: str, **run_extra: object) -> TandemConfig:
    return parse_config({"run": {"name": run, "checkpoint_root": str(tmp_path / "ck"), "total_steps": 100,
                                 "output_dir": str(tmp_path / "runs"), **run_extra},
                         "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
                         "agents": {"A": {"model_path": str(model), "max_staleness": 0, "groups_per_batch": 1}}})


def sample(group: str, reward: float, version: int = 0) -> Sample:
    return make_sample(group, reward, version=version, tokens=[5, 6, 7, 40, 41], loss_mask=[0, 0, 0, 1, 1],
                       logprobs=[0.0, 0.0, 0.0, -3.0, -3.0])


def batch(step: int) -> Batch:
    return Batch(agent="A", weight_version=step, samples=[sample(f"g{step}", 1.0), sample(f"g{step}", 0.0)])


async def trainer_for(cfg: TandemConfig, redis_url: str) -> TrainerService:
    bus = Bus(redis_url, cfg.run.name, "trainer-A")
    policy = await asyncio.to_thread(make_policy, cfg.agents["A"], 1.0)
    trainer = TrainerService(cfg, "A", bus, policy)
    trainer.history.batch = 1  # spill at every step past the kept ones (the default moves 16 at once)
    await trainer.resume()
    return trainer


async def test_trainer_log_spill_survives_restart_and_redelivery(redis_url: str, tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    cfg = config(tmp_path, tiny_model_dir, "bound-trainer", state_kept_steps=4)
    trainer = await trainer_for(cfg, redis_url)
    r, s = trainer.bus.redis, trainer.bus.streams
    batches = [batch(k) for k in range(1, 7)]
    for b in batches:
        await trainer.on_batch(b)
    assert [json.loads(x)["version"] for x in await r.lrange(s.train_log("A"), 0, -1)] == [3, 4, 5, 6]
    archive = train_log_archive(cfg.run.checkpoint_root, cfg.run.name, "A")
    assert [rec["version"] for rec in read_jsonl(archive)] == [1, 2]
    kept_ids = {x.id for b in batches[2:] for x in b.samples}
    assert {m.decode() for m in await r.smembers(s.trained_samples("A"))} == kept_ids  # exactly the kept records'
    await trainer.bus.close()

    # kill -9 after the commit of version 6, before its batch was acknowledged: a fresh trainer gets it again
    trainer = await trainer_for(cfg, redis_url)
    assert trainer.weight_version == 6
    await trainer.on_batch(batches[-1])
    assert trainer.weight_version == 6 and await r.llen(s.train_log("A")) == 4  # refused, not trained again
    await trainer.on_batch(batch(7))
    await trainer.bus.close()

    log = await read_train_log(r, s, "A", archive)
    assert [rec.weight_version for rec in log] == list(range(1, 8))
    trained = [sid for rec in log for sid in rec.sample_ids]
    assert len(trained) == len(set(trained)) == 14  # every sample in exactly one step
    versions = await RunRecord(trainer.bus, cfg.run.checkpoint_root).versions("A")
    assert [rec.weight_version for rec in versions.trained] == list(range(1, 8))  # the report sees every step
    assert (await committed(r, s, "A", 7)).weight_version == 7  # the rollout's check finds the newest versions
    assert (await committed(r, s, "A", 4)).weight_version == 4
    assert await committed(r, s, "A", 1) is None  # archived: older than any rollout can still load


async def test_spill_crash_windows(redis_url: str, tmp_path: Path) -> None:
    bus = Bus(redis_url, "bound-spill", "trainer-A")
    r, s = bus.redis, bus.streams
    records = [{"version": v, "batch_id": f"b{v}", "sample_ids": [f"s{v}"]} for v in range(1, 9)]
    await r.rpush(s.train_log("A"), *[json.dumps(x) for x in records])
    await r.sadd(s.trained_samples("A"), *[f"s{v}" for v in range(1, 9)])
    archive = tmp_path / "train_log.jsonl"
    spill = TrainLogSpill(r, s, "A", archive, kept=4)
    # a crash after appending versions 1-2 to the archive, before the trim; then a torn half line
    await asyncio.to_thread(append_jsonl, archive, [json.dumps(x).encode() for x in records[:2]])
    torn = json.dumps(records[2]).encode()[:10]
    await asyncio.to_thread(lambda: archive.write_bytes(archive.read_bytes() + torn))
    assert await spill.spill() == 0  # fewer than a batch due
    assert await spill.spill(force=True) == 4
    lines = archive.read_bytes().splitlines()
    assert all(json.loads(x) for x in lines)  # the torn line was cut, no record merged into it
    assert [rec["version"] for rec in read_jsonl(archive)] == [1, 2, 1, 2, 3, 4]
    assert [rec.weight_version for rec in await read_train_log(r, s, "A", archive)] == list(range(1, 9))
    assert {m.decode() for m in await r.smembers(s.trained_samples("A"))} == {f"s{v}" for v in range(5, 9)}
    await bus.close()


async def test_a_spill_between_the_two_reads_loses_no_record(redis_url: str, tmp_path: Path) -> None:
    """The trainer spills while the coordinator reads its log (a restore after a kill): the spill moves
    versions 1-4 to the archive just before the read reaches Redis. Every version is still read."""
    bus = Bus(redis_url, "bound-spill-race", "trainer-A")
    r, s = bus.redis, bus.streams
    records = [{"version": v, "batch_id": f"b{v}", "sample_ids": [f"s{v}"]} for v in range(1, 9)]
    await r.rpush(s.train_log("A"), *[json.dumps(x) for x in records])
    archive = tmp_path / "train_log.jsonl"
    spill = TrainLogSpill(r, s, "A", archive, kept=4)

    class SpillFirst:  # the real client; its first read of the log waits for a spill to commit
        def __init__(self) -> None:
            self.spilled = False

        async def lrange(self, *args: object) -> list[bytes]:
            if not self.spilled:
                self.spilled = True
                assert await spill.spill(force=True) == 4
            return await r.lrange(*args)

    versions = [rec.weight_version for rec in await read_train_log(SpillFirst(), s, "A", archive)]
    assert versions == list(range(1, 9)) and archive.exists()
    await bus.close()


async def test_ledger_prune_restart_and_replay(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = config(tmp_path, tiny_model_dir, "bound-ledger", state_kept_steps=4)
    bus = Bus(redis_url, cfg.run.name, "coordinator")
    r, s = bus.redis, bus.streams
    buffer = BufferService(cfg, "A", Bus(redis_url, cfg.run.name, "buffer-A"))
    groups = {g: [sample(g, 1.0, v), sample(g, 0.0, v)] for g, v in (("old", 0), ("old2", 0), ("recent", 6))}
    groups["waiting"] = [sample("waiting", 1.0, 0), sample("waiting", 0.0, 0)]  # kept, never released
    groups["open"] = [sample("open", 1.0, 0), sample("open", 0.0, 0)]  # one member never arrives
    await emit(bus, *[x for ss in groups.values() for x in ss])
    for g in ("old", "old2", "recent"):
        for x in groups[g]:
            await buffer.on_sample(x)  # complete: kept, released in a batch (one group a batch)
    await r.set(s.batches_released("A"), 100)  # the run's last batch is released: "waiting" stays ready
    for x in [*groups["waiting"], groups["open"][0]]:
        await buffer.on_sample(x)
    await r.set(s.published_weight_version("A"), 9)  # horizon = 0 + 1 + max(4, 0 + 4) = 5: version 6 is recent
    await r.hset(s.buffer_verdicts("A"), "old2", "dropped:non-finite training step")
    ledger = GroupLedger(bus, ["A"], cfg.run_dir(), horizons(cfg))
    before = await ledger.outcomes("A")
    await ledger.launch("lost", 99, {"A"})
    await ledger.abandon("lost", {"A"}, "timeout: still playing after 600s")
    await r.hset(ledger.key("A"), "lost", json.dumps({"state": "abandoned", "at": 1.0, "reason": "timeout"}))

    assert await ledger.prune("A") == 3  # old, old2 (final, past the horizon) and the old abandoned group
    left = set((await r.hgetall(ledger.key("A"))).keys())
    assert left == {b"recent", b"waiting", b"open"}
    assert set(await r.hkeys(s.buffer_verdicts("A"))) == {b"recent", b"waiting"}
    assert [rec["group_id"] for rec in read_jsonl(ledger.archive("A"))] == ["lost", "old", "old2"]

    # a restarted coordinator counts every group, archived or not, with the same outcome
    restarted = GroupLedger(bus, ["A"], cfg.run_dir(), horizons(cfg))
    after = await restarted.outcomes("A")
    assert {g: (o.state, o.reason) for g, o in after.items() if g != "lost"} == {
        g: (o.state, o.reason) for g, o in before.items()}
    assert (after["old2"].state, after["lost"].state) == ("dropped", "abandoned")

    # a sample of a pruned group replayed to the buffer is refused alone, never stored again
    with pytest.raises(Reject, match="emitted no group"):
        await buffer.on_sample(groups["old"][0])
    assert not await r.hexists(s.buffer_samples("A"), groups["old"][0].id)
    assert await ledger.prune("A") == 0  # nothing else is final and old enough

    # a verdict the buffer changes between the prune's read and its delete stays (archived again next time)
    await r.set(s.published_weight_version("A"), 30)
    await r.delete(s.buffer_group("A", "waiting"))
    forget = await ledger._forget(keys=[ledger.key("A"), s.buffer_verdicts("A")], args=["recent", "dropped:stale"])
    assert forget == 0 and await r.hexists(ledger.key("A"), "recent")
    assert await ledger.prune("A") == 2  # recent and waiting, now past the horizon
    assert [rec["group_id"] for rec in read_jsonl(ledger.archive("A"))][-2:] == ["recent", "waiting"]
    assert set((await r.hgetall(ledger.key("A"))).keys()) == {b"open"}  # undecided: kept
    await bus.close()
    await buffer.bus.close()


async def test_train_play_counts_move_and_survive_crashes(redis_url: str, tmp_path: Path) -> None:
    bus = Bus(redis_url, "bound-play", "coordinator")
    r, key = bus.redis, bus.streams.key("coord:train_play")
    for v in range(1, 11):
        await train_play.save(r, key, {("A", v): PlayCounts(2, 1, 6, 1, 0.5), ("B", v): PlayCounts(2, 0, 6, 0, -0.5)})
    full = await play_archive.load(r, key, tmp_path)
    assert await play_archive.prune(r, key, tmp_path, {"A": 6}) == 25  # A's versions 1-5, five fields each
    assert {f.decode().split("|")[1] for f in await r.hkeys(key) if f.startswith(b"A|")} == {"6", "7", "8", "9", "10"}
    assert await play_archive.load(r, key, tmp_path) == full  # a restart sees every version

    # a late episode of a moved version counts again; a crash after the move, before the archive append
    await train_play.save(r, key, {("A", 2): PlayCounts(1, 0, 3, 0, 1.0)})
    full[("A")][2].add(PlayCounts(1, 0, 3, 0, 1.0))
    script = r.register_script(play_archive.MOVE)
    assert await script(keys=[key, key + ":staging", key + ":seq"], args=["A|2|episodes", "A|2|replies"])
    assert await play_archive.load(r, key, tmp_path) == full  # staged, counted once
    # ... and a crash after the append, before the staging hash is dropped
    staged = {k.decode(): v.decode() for k, v in (await r.hgetall(key + ":staging")).items()}
    seq = int(staged.pop("_seq"))
    append_jsonl(tmp_path / play_archive.ARCHIVE, [json.dumps({"seq": seq, "counts": staged}).encode()])
    assert await play_archive.load(r, key, tmp_path) == full
    assert await play_archive.prune(r, key, tmp_path, {"A": 6, "B": 3}) > 0
    assert not await r.exists(key + ":staging")
    assert await play_archive.load(r, key, tmp_path) == full
    await bus.close()
