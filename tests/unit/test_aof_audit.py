"""The audit library (tests/aof_audit.py) on hand-made states: each broken promise is named, a sound run passes."""

from __future__ import annotations

from tests import aof_audit
from tests.aof_audit import AgentState
from tests.helpers import make_sample


def _state(**over) -> AgentState:
    s = {g: [make_sample(g, episode_id=f"{g}{i}") for i in range(2)] for g in ("g1", "g2", "g3", "g4")}
    entries = [(f"{i + 1}-0", x) for i, x in enumerate(x for g in s.values() for x in g)]
    base = dict(agent="A", entries=entries, last_delivered="8-0", pending={"8-0"},
                verdicts={"g1": "kept", "g2": "dropped:zero reward variance", "g3": "abandoned:timeout: late",
                          "g4": "kept"},
                ledger={}, ready=["g4"],
                train_log=[{"version": 1, "sample_ids": [x.id for x in s["g1"]]}])
    base.update(over)
    return AgentState(**base)


def test_a_sound_run_passes_and_every_sample_has_its_place():
    st = _state()
    assert aof_audit.problems(st, 1) == []
    # entry 8 is pending (not acknowledged): 7 acknowledged samples, g4's one acknowledged sample unused
    assert aof_audit.account(st).counts() == {"trained": 2, "dropped": 2, "abandoned": 2, "unused": 1,
                                              "unaccounted": 0}
    assert aof_audit.reasons(st) == {"dropped: zero reward variance": 2, "abandoned: timeout": 2}


def test_each_broken_promise_is_named():
    st = _state()
    twice = st.train_log[0]["sample_ids"]
    st.train_log.append({"version": 3, "sample_ids": [twice[0], st.entries[7][1].id]})
    st.verdicts["g3"] = "abandoned:"
    st.ready = []
    found = " | ".join(aof_audit.problems(st, 2))
    assert "weight versions [1, 3], not 1..2" in found
    assert "1 sample(s) trained more than once" in found
    assert "1 trained sample(s) the buffer never acknowledged" in found  # the pending entry 8
    assert "1 acknowledged sample(s) in no trained batch" in found  # g4's, no longer queued
    assert "2 dropped/abandoned sample(s) without a reason" in found


def test_a_group_the_coordinator_abandoned_accounts_for_its_samples():
    st = _state(verdicts={"g1": "kept", "g2": "dropped:stale", "g4": "kept"},
                ledger={"g3": {"state": "abandoned", "reason": "coordinator restarted while the group was playing"},
                        "g5": {"state": "abandoned", "reason": "no turn in any episode"}})
    assert aof_audit.problems(st, 1) == []
    assert aof_audit.ledger_reasons(st) == {"coordinator restarted while the group was playing": 1,
                                            "no turn in any episode": 1}
