"""The buffer's store against a real Redis, and the coordinator's launch gate."""

from __future__ import annotations

from services.buffer.store import SampleStore
from services.common.bus import Bus
from services.contracts.codec import decode
from services.contracts.messages import Batch, Sample
from services.coordinator.state import AgentState
from tests.helpers import emit, make_sample


def sample(group: str, reward: float, version: int = 0, size: int = 2, agent: str = "A") -> Sample:
    return make_sample(group, reward, agent=agent, size=size, version=version)


async def batches(bus: Bus) -> list[Batch]:
    return [decode(f[b"d"], Batch) for _, f in await bus.redis.xrange(bus.streams.batches("A"))]


async def test_redelivered_samples_are_stored_once_and_repeat_the_verdict(redis_url):
    bus = Bus(redis_url, "t", "buffer-A")
    store = SampleStore(bus, "A", groups_per_batch=2, max_staleness=0)
    a, b = sample("g1", 1.0), sample("g1", -1.0)
    await emit(bus, a, b)
    assert await store.add(a) is None
    assert await store.add(a) is None  # redelivery before the group is complete
    verdict = await store.add(b)
    assert verdict is not None and verdict.kept
    again = await store.add(b)  # redelivery after the verdict: same verdict, nothing stored twice
    assert again is not None and again.kept and again.group_id == "g1"
    assert await bus.redis.hlen(store.k_samples) == 2
    assert await bus.redis.llen(store.k_ready) == 1
    await bus.close()


async def test_a_batch_takes_whole_groups_once(redis_url):
    bus = Bus(redis_url, "t", "buffer-A")
    store = SampleStore(bus, "A", groups_per_batch=2, max_staleness=0, max_batches=1)
    samples = [sample(g, r) for g in ("g1", "g2", "g3", "g4") for r in (1.0, 0.0)]
    await emit(bus, *samples)
    for s in samples:
        await store.add(s)
    released, dropped = await store.release()
    assert len(released) == 1 and not dropped  # max_batches caps the run's last step
    (batch,) = await batches(bus)
    assert batch.weight_version == 1 and {s.group_id for s in batch.samples} == {"g1", "g2"}
    assert len(batch.samples) == 4
    assert await bus.redis.hlen(store.k_samples) == 4  # g3, g4 wait, unused
    await bus.close()


async def test_stale_groups_are_dropped_and_reported_as_once_kept(redis_url):
    bus = Bus(redis_url, "t", "buffer-A")
    store = SampleStore(bus, "A", groups_per_batch=1, max_staleness=0)
    await bus.redis.set(store.k_released, 3)  # the next batch trains towards version 4
    samples = [sample(g, r, version=v) for g, v in (("old", 1), ("new", 3)) for r in (1.0, 0.0)]
    await emit(bus, *samples)
    for s in samples:
        await store.add(s)
    released, dropped = await store.release()
    assert [d.group_id for d in dropped] == ["old"] and dropped[0].was_kept and dropped[0].reason == "stale"
    assert [b.weight_version for b in released] == [4]
    assert {s.group_id for s in released[0].samples} == {"new"}
    await bus.close()


async def test_zero_variance_filter_and_wrong_agent(redis_url):
    bus = Bus(redis_url, "t", "buffer-A")
    store = SampleStore(bus, "A", groups_per_batch=1, max_staleness=0, filter_zero_variance=True)
    flat = [sample("flat", 1.0), sample("flat", 1.0)]
    await emit(bus, *flat)
    await store.add(flat[0])
    verdict = await store.add(flat[1])
    assert verdict is not None and not verdict.kept and verdict.reason == "zero reward variance"
    assert await bus.redis.hlen(store.k_samples) == 0
    try:
        await store.add(sample("x", 1.0, agent="B"))
    except ValueError as exc:
        assert "agent 'B'" in str(exc)
    else:
        raise AssertionError("a sample of B was accepted by A's buffer")
    await bus.close()


def test_launch_gate_on_policy_and_one_behind():
    on = AgentState("A", groups_per_batch=2, max_staleness=0, total_steps=3)
    behind = AgentState("B", groups_per_batch=2, max_staleness=1, total_steps=3)
    for st in (on, behind):
        st.in_flight_groups = 2
    assert on.blocked_by_staleness() and not behind.blocked_by_staleness()
    for gid in ("g0", "g1"):
        on.resolve_group(gid, "kept")
    assert on.kept_groups == 2 and on.in_flight_groups == 0 and on.blocked_by_staleness()
    on.loaded_weight_version = 1  # version 1 loaded: the groups of step 2 may start
    assert not on.blocked_by_staleness() and on.wants_groups()


def test_group_outcomes_apply_once_and_stale_undoes_kept():
    st = AgentState("A", groups_per_batch=4, max_staleness=0, total_steps=2)
    st.in_flight_groups = 3
    st.resolve_group("g0", "kept")
    st.resolve_group("g0", "kept")  # duplicate event
    st.resolve_group("g1", "abandoned", "no turn in any episode")
    st.resolve_group("g2", "dropped")
    assert (st.kept_groups, st.dropped_groups, st.in_flight_groups) == (1, 1, 0)
    assert st.abandoned_groups == 1 and st.abandon_reasons == {"no turn in any episode": 1}
    st.resolve_group("g0", "dropped")  # stale at release: no longer counts as kept
    assert (st.kept_groups, st.dropped_groups) == (0, 2)
    st.kept_groups = 8
    assert not st.wants_groups()
