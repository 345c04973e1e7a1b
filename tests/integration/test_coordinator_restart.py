"""A coordinator restarted at any moment rebuilds its run from Redis (real Redis, the class driven
directly): groups from the ledger and the buffers' verdicts, versions from the rollout's and the
trainer's keys, evaluations and flags from its run record; the report then counts every step."""

from __future__ import annotations

import json
from pathlib import Path

from services.buffer.store import SampleStore
from services.common.bus import Bus
from services.contracts.codec import FIELD, decode
from services.contracts.config import TandemConfig, parse_config
from services.contracts.messages import EngineStatus, Event, GroupDone, RolloutLoad, Sample
from services.contracts.players import Local, Pool
from services.coordinator.ledger import RESTARTED
from services.coordinator.scheduler import Coordinator
from tests.helpers import make_sample

STEP = {"loss": 0.5, "pg_loss": 0.4, "clip_frac": 0.1, "reward_mean": 0.25}


def make_config(redis_url: str, model: str, out: Path) -> TandemConfig:
    agent = {"model_path": model, "groups_per_batch": 1, "filter_zero_variance": True}
    return parse_config({"run": {"name": "rs", "total_steps": 2, "output_dir": str(out)}, "redis_url": redis_url,
                         "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}, "group_size": 2,
                                         "eval": {"episodes": 2}},
                         "agents": {"A": agent, "B": agent}})


def sample(agent: str, group: str, reward: float) -> Sample:
    return make_sample(group, reward, agent=agent, episode_id=f"{group}-{agent}-{reward}")


async def buffer_verdicts(bus: Bus, agent: str) -> list[Event]:
    """What the agent's buffer does with the samples on its stream: store them, decide their groups."""
    store = SampleStore(bus, agent, groups_per_batch=1, max_staleness=0, filter_zero_variance=True)
    events = []
    for _, fields in await bus.redis.xrange(bus.streams.samples(agent)):
        v = await store.add(decode(fields[FIELD], Sample))
        if v is not None:
            events.append(GroupDone(source=f"buffer-{agent}", agent=agent, group_id=v.group_id,
                                    outcome=v.outcome, reason=v.reason or None, was_kept=v.was_kept))
    return events


async def trained(bus: Bus, agent: str, version: int, loaded: bool) -> None:
    """The trainer's commit of ``version`` (its train log) and, if ``loaded``, the rollout's loaded key."""
    s = bus.streams
    rec = {"version": version, "batch_id": f"b{version}", "sample_ids": [], "path": f"/ckpt/{agent}/v{version}",
           "checksum": "c", "metrics": {**STEP, "version": version, "batch_step": version}}
    await bus.redis.rpush(s.train_log(agent), json.dumps(rec))
    if loaded:
        await bus.redis.set(s.loaded_weight_version(agent), version)


async def test_a_restarted_coordinator_rebuilds_its_run(redis_url: str, tiny_model_dir: Path, tmp_path: Path):
    cfg = make_config(redis_url, str(tiny_model_dir), tmp_path / "runs")
    first = Coordinator(cfg, Bus(redis_url, "rs", "coordinator"))
    await first.restore()
    await first.control("pause")
    led = first.groups.ledger
    for i, gid in enumerate(("g1", "g2", "g3")):
        await led.launch(gid, i, {"A", "B"})
    await led.emit("g1", [sample("A", "g1", 1.0), sample("A", "g1", 0.0),
                          sample("B", "g1", 0.0), sample("B", "g1", 1.0)], {})
    await led.emit("g2", [sample("A", "g2", 1.0), sample("A", "g2", 1.0)], {"B": "no turn in any episode"})
    # g3 is playing when the coordinator dies
    events = {a: await buffer_verdicts(first.bus, a) for a in ("A", "B")}
    for ev in events["A"][:1] + events["B"]:  # A's verdict on g2 arrives while the coordinator is down
        await first.events.on_event(ev)
    await trained(first.bus, "A", 1, loaded=True)
    await trained(first.bus, "A", 2, loaded=False)  # trained, not yet on the engines
    await trained(first.bus, "B", 1, loaded=True)
    first.evals.append({"label": "start", "time": 1.0, "scores": {"A": 0.4, "B": 0.3}, "details": {},
                        "versions": {"A": 0, "B": 0}})
    await first.evaluations.save()
    await first.bus.close()

    second = Coordinator(cfg, Bus(redis_url, "rs", "coordinator"))
    await second.restore()
    st = second.state
    assert st.paused and st.started_at == first.state.started_at and st.groups_launched == 3
    a, b = st.agents["A"], st.agents["B"]
    assert (a.kept_groups, a.dropped_groups, a.abandoned_groups, a.in_flight_groups) == (1, 1, 1, 0)
    assert (b.kept_groups, b.dropped_groups, b.abandoned_groups, b.in_flight_groups) == (1, 0, 2, 0)
    assert b.abandon_reasons == {"no turn in any episode": 1, RESTARTED: 1}
    assert a.loaded_weight_version == 1 and a.loaded_weight_versions == [1]
    assert [t["weight_version"] for t in a.train_steps] == [1, 2]
    assert {k: a.train_steps[0][k] for k in STEP} == STEP
    assert (pool := second.players.pool_paths["A"]) == [str(tiny_model_dir), "/ckpt/A/v1"]
    assert second.players.resolve_pool({"O": Pool(agent="A")})["O"] in {Local(path=p, agent="A") for p in pool}
    assert (a.eval_start, b.eval_start) == (0.4, 0.3) and [e["label"] for e in second.evals] == ["start"]
    assert len(a.group_rewards) == 2 and len(b.group_rewards) == 1
    for ev in events["A"] + events["B"]:  # the events stream redelivers what it had not acknowledged
        await second.events.on_event(ev)
    assert (a.kept_groups, a.dropped_groups, a.abandoned_groups) == (1, 1, 1)
    assert (b.kept_groups, b.abandoned_groups) == (1, 2)
    await second.control("resume")
    await second.bus.close()

    # the run ends while the coordinator is down: both agents at their last version, both evaluations done
    bus = Bus(redis_url, "rs", "test")
    await trained(bus, "B", 2, loaded=True)
    await bus.redis.set(bus.streams.loaded_weight_version("A"), 2)
    await bus.redis.rpush(bus.streams.key("coord:evals"), json.dumps(
        {"label": "end", "time": 2.0, "scores": {"A": 0.6, "B": 0.5}, "details": {}, "versions": {"A": 2, "B": 2}}))
    await bus.close()
    third = Coordinator(cfg, Bus(redis_url, "rs", "coordinator"))
    await third.restore()
    assert not third.state.paused
    for agent in ("A", "B"):
        await third.events.on_event(RolloutLoad(source="rollout", agent=agent,
                                                engines=[EngineStatus(url="http://e", healthy=True)]))
    await third.run_and_report()  # no episode is played: nothing is left to run
    assert third.state.phase == "done" and third.state.episodes_done == 0
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    for agent, start, end in (("A", 0.4, 0.6), ("B", 0.3, 0.5)):
        got = summary["agents"][agent]
        assert (got["steps"], got["weight_versions"], got["last_weight_version"]) == (2, 2, 2)
        assert (got["eval_start"], got["eval_end"]) == (start, end)
    assert summary["agents"]["A"]["groups_kept"] == 1 and summary["agents"]["A"]["groups_abandoned"] == 1
    assert [e["label"] for e in summary["evals"]] == ["start", "end"]
    await third.bus.close()


async def test_pause_stays_in_the_coordinator_and_a_stop_command_ends_the_run(redis_url: str, tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    from services.contracts.messages import Control

    cfg = make_config(redis_url, str(tiny_model_dir), tmp_path / "runs")
    coord = Coordinator(cfg, Bus(redis_url, "rs", "coordinator"))
    await coord.restore()
    await coord.control("pause")
    await coord.control("resume")
    await coord.control("pause")
    assert await coord.bus.redis.xlen(coord.bus.streams.control) == 0  # no round trip through the control stream
    await coord.on_control(Control(command="stop"))  # a stop from elsewhere: graceful, recorded
    again = Coordinator(cfg, Bus(redis_url, "rs", "coordinator"))
    await again.restore()
    assert again.state.paused and again.state.stop_requested
    await coord.bus.close()
    await again.bus.close()
