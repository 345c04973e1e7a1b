"""Rules and rewards of the reference recipes' last two patterns, with scripted players (fast).

Support desk (three roles: customer, agent, manager) and explore-then-exploit
(explorer, exploiter): services/envs/support_desk.py and explore_exploit.py;
their configs load and pass the environment checks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.contracts.config import load_config
from services.envs.explore_exploit import ExploreExploit, two_numbers
from services.envs.registry import check_environment_config, load_environment
from services.envs.support_desk import AMOUNTS, ISSUES, SupportDesk, parse_action, parse_claim
from tests.unit.test_envs import play, step

REPO = Path(__file__).resolve().parents[2]
GOOD = {"customer": "honest", "agent": "by_policy", "manager": "by_record"}


def desk(issue: str, amount: int, **params: object) -> SupportDesk:
    """A ticket with the given ground truth (the seed's draw replaced)."""
    env = SupportDesk(dict(params), 0)
    env.issue, env.amount = issue, amount
    env.customer_note = f"You are the customer: {issue}, ${amount}."
    return env


# --- support desk -----------------------------------------------------------------
def test_support_desk_tickets_are_seeded_and_varied() -> None:
    a, b = SupportDesk({}, 5), SupportDesk({}, 5)
    assert (a.issue, a.amount) == (b.issue, b.amount)
    drawn = [(e.issue, e.amount) for e in (SupportDesk({}, s) for s in range(200))]
    assert {i for i, _ in drawn} == set(ISSUES) and {m for _, m in drawn} == set(AMOUNTS)
    needed = sum(SupportDesk({}, s).escalation_needed() for s in range(200))
    assert 30 < needed < 120  # the manager has work in a fair share of tickets


@pytest.mark.parametrize(("issue", "amount", "escalated"), [
    ("damaged", 30, False), ("overcharged", 90, True), ("lost", 150, False), ("locked", 20, False)])
def test_good_players_resolve_every_kind_of_ticket_and_escalate_only_big_refunds(
        issue: str, amount: int, escalated: bool) -> None:
    env = desk(issue, amount)
    result, turns = play(env, GOOD)
    assert result.done and env.resolved() and env.escalated is escalated
    assert env.by == ("manager" if escalated else "agent")
    assert result.rewards == {"customer": 1.0, "agent": 1.0, "manager": 1.0 if escalated else 0.0}
    assert turns == {"customer": 0.2}
    assert env.summary()["format_failures"] == {"customer": 0, "agent": 0, "manager": 0}


def test_refund_over_the_cap_by_the_agent_breaks_the_policy() -> None:
    env = desk("damaged", 90)
    result, _ = play(env, {**GOOD, "agent": "overrefund"})
    assert env.resolved() and not env.escalated and result.info["policy_broken"]
    assert result.rewards == {"customer": 1.0, "agent": 0.0, "manager": 0.0}  # resolved, less the policy penalty


def test_needless_escalation_costs_the_agent_and_the_manager_is_consulted() -> None:
    env = desk("lost", 20)
    result, _ = play(env, {**GOOD, "agent": "always_escalate"})
    assert env.escalated and env.resolved() and env.by == "manager"
    assert result.rewards == {"customer": 1.0, "agent": pytest.approx(0.7), "manager": 1.0}
    env = desk("damaged", 150)  # needed: no cost
    result, _ = play(env, {**GOOD, "agent": "always_escalate"})
    assert result.rewards == {"customer": 1.0, "agent": 1.0, "manager": 1.0}


def test_greedy_customer_is_penalised_and_a_rubber_stamp_manager_breaks_the_policy() -> None:
    env = desk("overcharged", 60)
    result, turns = play(env, {"customer": "greedy", "agent": "by_policy", "manager": "rubber_stamp"})
    assert env.escalated and env.final == ("refund", 120) and not env.resolved()
    assert turns == {"customer": -0.3}
    assert result.rewards == {"customer": 0.0, "agent": 0.0, "manager": -1.0}
    env = desk("overcharged", 60)  # a manager going by the record corrects the claim
    result, _ = play(env, {"customer": "greedy", "agent": "by_policy", "manager": "by_record"})
    assert env.resolved() and result.rewards["manager"] == 1.0 and result.rewards["customer"] == 1.0
    env = desk("damaged", 20)  # a claim under the cap: the agent over-refunds, breaking the policy
    result, _ = play(env, {"customer": "greedy", "agent": "by_policy", "manager": "by_record"})
    assert env.final == ("refund", 40) and not env.escalated and result.rewards["agent"] == -1.0


def test_vague_customer_is_asked_to_restate_then_escalated() -> None:
    env = desk("locked", 45)
    result, turns = play(env, {**GOOD, "customer": "vague"})
    assert env.asks == 1 and env.escalated and env.resolved()  # the manager reads the record
    assert env.format_failures["customer"] == 2 and turns["customer"] == pytest.approx(-0.4)
    assert turns["agent"] == pytest.approx(-0.05) and result.rewards["agent"] == pytest.approx(1.0 - 0.3)
    assert "restate" in env.observation("customer")


def test_malformed_agent_reply_goes_to_the_manager_and_malformed_manager_resolves_nothing() -> None:
    env = desk("damaged", 30)
    step(env, "It is damaged, $30")
    r = step(env, "9 9 9 x")
    assert not r.done and r.turn_rewards == {"agent": -0.2} and env.current_role() == "manager"
    assert "Record: damaged, order $30" in env.observation("manager")
    r = step(env, "??")
    assert r.done and not env.resolved() and r.rewards == {"customer": 0.0, "agent": -0.3, "manager": 0.0}
    assert r.turn_rewards == {"manager": -0.2}
    assert env.summary()["format_failures"] == {"customer": 0, "agent": 1, "manager": 1}
    env = desk("damaged", 90)
    step(env, "damaged 90")
    step(env, "escalate")
    r = step(env, "deny")
    assert r.done and env.final is None and r.rewards == {"customer": 0.0, "agent": 0.0, "manager": 0.0}


def test_support_desk_parsing_is_lenient_about_form() -> None:
    assert parse_claim("My ORDER was Damaged!! I paid $60 for it") == ("damaged", 60)
    assert parse_claim("help") == (None, None)
    assert parse_action("  Refund $45 please", ("refund", "reset")) == ("refund", 45)
    assert parse_action("I will reset your password", ("refund", "reset")) == ("reset", None)
    assert parse_action("refund it", ("refund",)) is None  # a refund needs an amount
    assert parse_action("deny", ("refund", "escalate")) is None
    assert parse_action("refunded", ("refund",)) is None


def test_support_desk_turn_order_is_enforced() -> None:
    env = desk("lost", 30)
    with pytest.raises(ValueError, match="customer's turn"):
        asyncio.run(env.step("agent", "reship"))


# --- explore then exploit ------------------------------------------------------------
def test_triangulating_explorer_and_following_exploiter_find_every_treasure() -> None:
    for seed in range(60):
        env = ExploreExploit({"size": 5, "probes": 3}, seed)
        result, turns = play(env, {"explorer": "triangulate", "exploiter": "follow"})
        assert env.found() and result.rewards == {"explorer": 1.0, "exploiter": 1.0}
        assert turns == {"explorer": pytest.approx(-0.04)} and len(env.probes) == 2
        assert env.summary()["format_failures"] == {"explorer": 0, "exploiter": 0}


def test_the_exploiter_sees_only_the_report() -> None:
    env = ExploreExploit({"size": 5}, 3)
    step(env, "probe 0 0")
    assert env.observation("explorer").startswith("Distance ")
    step(env, "report treasure near 1 2, I think")
    obs = env.observation("exploiter")
    assert "treasure near 1 2" in obs and "Distance" not in obs and str(env.treasure) not in obs
    assert env.current_role() == "exploiter"


def test_outcome_is_shared_and_falls_with_the_distance() -> None:
    env = ExploreExploit({"size": 5}, 0)
    env.treasure = (1, 1)
    step(env, "report dig at 4 4")
    r = step(env, "dig 4 4")
    assert r.rewards == {"explorer": -0.5, "exploiter": -0.5}  # distance 6 of at most 8: 1 - 6/4
    for player in ("liar", "lazy"):
        e = ExploreExploit({"size": 5}, 11)
        result, _ = play(e, {"explorer": player, "exploiter": "follow"})
        assert not e.found() and result.rewards["explorer"] == result.rewards["exploiter"] < 1.0, player


def test_explorer_format_failures_use_up_probes_and_empty_report_is_counted() -> None:
    env = ExploreExploit({"size": 4, "probes": 2}, 0)
    r = step(env, "look around")
    assert r.turn_rewards == {"explorer": pytest.approx(-0.22)} and env.used == 1
    r = step(env, "probe 9 9")  # off the grid
    assert r.turn_rewards == {"explorer": pytest.approx(-0.22)} and env.current_role() == "explorer"
    r = step(env, "   ")
    assert r.turn_rewards == {"explorer": -0.2} and env.current_role() == "exploiter"
    r = step(env, "no idea")
    assert r.done and r.rewards == {"explorer": -1.0, "exploiter": -1.0} and r.turn_rewards == {"exploiter": -0.2}
    assert env.summary()["format_failures"] == {"explorer": 3, "exploiter": 1}


def test_early_report_and_probe_parsing() -> None:
    env = ExploreExploit({"size": 5, "probes": 3}, 2)
    step(env, "Probe (2, 3)")
    assert env.probes == [(2, 3, env.distance((2, 3)))]
    step(env, "Report: it is at 0 4")
    assert env.report == "it is at 0 4" and env.current_role() == "exploiter"
    assert two_numbers("dig row 2, col 3") == (2, 3) and two_numbers("dig 2") is None


# --- configs ---------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "agents"), [("support_desk", 3), ("explore_exploit", 2)])
def test_configs_train_every_agent_and_pass_the_environment_checks(name: str, agents: int) -> None:
    cfg = load_config(REPO / "configs" / f"{name}.yaml", environ={})
    assert load_environment(name) is check_environment_config(cfg.environment)
    assert len(cfg.agents) == agents and all(a.train for a in cfg.agents.values())
    assert len({str(p) for p in cfg.environment.roles.values()}) == agents  # one role each
