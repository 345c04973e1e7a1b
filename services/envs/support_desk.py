"""Support desk: a customer, a support agent and a manager settle a ticket (docs/architecture.md §8).

The three-role role-play pattern of the reference recipes: three agents, each
trained in one run, with rewards bilateral where it makes sense.

A ticket (drawn from the seed) has ground truth: an ``issue`` (``ISSUES``), the
order ``amount`` and so the correct resolution (``refund <amount>`` for
``damaged``/``overcharged``, ``reship`` for ``lost``, ``reset`` for ``locked``).
Policy: support may refund at most ``refund_cap``; a larger refund needs the
manager, so an escalation is warranted exactly when the right refund is above
the cap. Nobody may refund more than the order amount.

Protocol (customer -> agent [-> customer ...] [-> manager] -> end)
* customer: states the issue and the amount in free text ("my parcel is lost,
  $40"); the first issue word (or a plain word for it: ``ISSUE_WORDS``, "broken" for damaged) and the
  first number count. A reply with no issue
  word is a format failure (-``format_penalty``); a wrong issue or a claimed
  amount other than the true one costs ``misstate_penalty``; a clear and true
  statement earns ``clarity_reward`` (per turn).
* agent (sees only the customer's words and the policy): ``refund <n>``,
  ``reship``, ``reset``, ``escalate`` or ``ask`` (the customer restates; costs
  ``ask_cost``; after ``max_asks`` asks the ticket is escalated). Any other reply
  is a format failure (-``format_penalty``) and the ticket goes to the manager
  by default.
* manager (consulted only on escalation; sees the order record and what was
  said): ``refund <n>``, ``reship``, ``reset`` or ``deny``. Any other reply is a
  format failure (-``format_penalty``) and the ticket stays unresolved.

Final rewards
* resolved (the final action is the correct one, a refund of exactly the owed
  amount): +``resolve_reward`` to the customer, the agent and, when consulted,
  the manager; 0 otherwise.
* policy: the agent refunding above the cap, or anyone refunding more than the
  order amount, costs whoever did it ``policy_penalty``.
* escalation: an escalation that was not needed costs the agent ``escalation_cost``.
An unconsulted manager gets 0 (and no sample). ``summary()["format_failures"]``
counts format failures per role.

Each role's default system message tells a chat model its part (``params.system`` replaces it).

Scripted players: customer ``honest``, ``vague`` (no issue word), ``greedy``
(claims double); agent ``by_policy`` (right action, escalates only refunds over
the cap), ``always_escalate``, ``overrefund`` (refunds the claim, never
escalates); manager ``by_record`` (the record's resolution), ``rubber_stamp``
(refunds what the customer claimed), ``deny``.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from pydantic import Field

from services.envs.base import Environment, StepResult
from services.envs.params import ChatParams, EnvParams

ISSUES: dict[str, str] = {"damaged": "refund", "overcharged": "refund", "lost": "reship", "locked": "reset"}
STORIES = {"damaged": "your order arrived broken", "overcharged": "you were charged twice for an order",
           "lost": "your parcel never arrived", "locked": "you cannot log in to your account"}
AMOUNTS = (20, 30, 45, 60, 90, 150)
ISSUE_WORDS = {"broken": "damaged", "damage": "damaged", "overcharge": "overcharged", "twice": "overcharged",
               "missing": "lost", "lock": "locked"}  # plain words a customer uses for an issue
ACTION = re.compile(r"\b(refund|reship|reset|escalate|ask|deny)\b(?:[^\d.!?]{0,12}?(\d+))?", re.IGNORECASE)
AGENT_VERBS = ("refund", "reship", "reset", "escalate", "ask")
MANAGER_VERBS = ("refund", "reship", "reset", "deny")


def parse_claim(text: str) -> tuple[str | None, int | None]:
    """(first issue word, first number) of a customer's message; None where absent."""
    words = [ISSUE_WORDS.get(w, w) for w in re.findall(r"[a-z]+", text.lower())]
    issue = next((w for w in words if w in ISSUES), None)
    number = re.search(r"\d+", text)
    return issue, int(number.group()) if number else None


def parse_action(text: str, verbs: tuple[str, ...]) -> tuple[str, int | None] | None:
    """(verb, amount) of the first action word among ``verbs``; a refund needs an amount; None if none."""
    for m in ACTION.finditer(text):
        verb = m.group(1).lower()
        if verb not in verbs:
            continue
        amount = int(m.group(2)) if m.group(2) else None
        if verb == "refund" and amount is None:
            return None
        return verb, amount
    return None


class SupportDeskParams(ChatParams):
    refund_cap: int = Field(50, ge=0, le=10000, description="support's refund limit; above it needs the manager")
    max_asks: int = Field(1, ge=0, le=5, description="times support may ask the customer to restate")
    resolve_reward: float = Field(1.0, ge=0.0, le=10.0, description="everyone consulted, ticket resolved")
    policy_penalty: float = Field(1.0, ge=0.0, le=10.0, description="refund above the cap or the order amount")
    escalation_cost: float = Field(0.3, ge=0.0, le=10.0, description="agent, per escalation not needed")
    clarity_reward: float = Field(0.2, ge=0.0, le=10.0, description="customer, per clear true statement")
    misstate_penalty: float = Field(0.3, ge=0.0, le=10.0, description="customer, wrong issue or amount")
    ask_cost: float = Field(0.05, ge=0.0, le=1.0, description="agent, per ask")
    format_penalty: float = Field(0.2, ge=0.0, le=10.0)


class SupportDesk(Environment[SupportDeskParams]):
    roles: ClassVar[tuple[str, ...]] = ("customer", "agent", "manager")
    description: ClassVar[str] = ("Support desk: customer states a problem, agent resolves it within a refund cap "
                                  "or escalates, the manager decides escalations; all rewarded by a kept policy "
                                  "and a resolved ticket.")
    scripted_players: ClassVar[tuple[str, ...]] = (
        "honest", "vague", "greedy", "by_policy", "always_escalate", "overrefund", "by_record", "rubber_stamp",
        "deny")
    scripted_roles: ClassVar[dict[str, tuple[str, ...]]] = {
        "honest": ("customer",), "vague": ("customer",), "greedy": ("customer",),
        "by_policy": ("agent",), "always_escalate": ("agent",), "overrefund": ("agent",),
        "by_record": ("manager",), "rubber_stamp": ("manager",), "deny": ("manager",)}
    env_name: ClassVar[str] = "support_desk"
    summary_measures: ClassVar[tuple[str, ...] | None] = ("resolved", "escalated", "asks", "format_failures")
    default_system: ClassVar[dict[str, str]] = {
        "customer": ("You are a customer writing to support. Say in one short sentence what went wrong, using one "
                     "of the words damaged, overcharged, lost or locked, and the order amount in dollars. Example: "
                     "'My order arrived damaged, it cost $30.'"),
        "agent": ("You are a support agent. Read the customer's message and reply with exactly one action: "
                  "'refund <amount>' for a damaged or overcharged order, 'reship' for a lost parcel, 'reset' for a "
                  "locked account, 'escalate' to pass the ticket to your manager (needed for a refund above your "
                  "limit), or 'ask' to ask the customer to restate. Write nothing else."),
        "manager": ("You are a support manager deciding an escalated ticket from the order record. Reply with "
                    "exactly one action: 'refund <amount>' for a damaged or overcharged order, 'reship' for a lost "
                    "parcel, 'reset' for a locked account, or 'deny'. Write nothing else."),
    }

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        self.issue = self.rng.choice(sorted(ISSUES))
        self.amount = self.rng.choice(AMOUNTS)
        self.to_act = "customer"
        self.said: list[str] = []  # the customer's messages
        self.claim: tuple[str | None, int | None] = (None, None)
        self.agent_note = ""
        self.asks = 0
        self.escalated = False
        self.final: tuple[str, int | None] | None = None  # the action that closed the ticket
        self.by: str | None = None  # who closed it
        self.format_failures = dict.fromkeys(self.roles, 0)
        self.customer_note = (f"Write your message to support. What happened: {STORIES[self.issue]}; the order cost "
                              f"${self.amount}. Name the issue ({'/'.join(sorted(ISSUES))}) and the amount.")

    # --- ground truth -------------------------------------------------------
    def correct(self) -> tuple[str, int | None]:
        verb = ISSUES[self.issue]
        return verb, (self.amount if verb == "refund" else None)

    def escalation_needed(self) -> bool:
        verb, amount = self.correct()
        return verb == "refund" and (amount or 0) > self.params.refund_cap

    def resolved(self) -> bool:
        return self.final is not None and self.final == self.correct()

    # --- turns --------------------------------------------------------------
    def current_role(self) -> str:
        return self.to_act

    def observation(self, role: str) -> str:
        if role == "customer":
            return self.customer_note
        last = " ".join(self.said[-1].split())[:120] if self.said else ""
        if role == "agent":
            return (f"{self.agent_note}Customer: {last!r}. Policy: you may refund up to ${self.params.refund_cap}. "
                    "Reply: refund <n>, reship, reset, escalate or ask.")
        return (f"Escalated. Record: {self.issue}, order ${self.amount}. Customer: {last!r}. "
                "Reply: refund <n>, reship, reset or deny.")

    async def step(self, role: str, reply: str) -> StepResult:
        self.check_turn(role)
        if role == "customer":
            return self._customer(reply)
        if role == "agent":
            return self._agent(reply)
        return self._manager(reply)

    def _customer(self, reply: str) -> StepResult:
        p = self.params
        self.said.append(reply)
        self.claim = issue, amount = parse_claim(reply)
        self.to_act = "agent"
        if issue is None:
            self.format_failures["customer"] += 1
            return StepResult(done=False, turn_rewards={"customer": -p.format_penalty},
                              info={"malformed": reply[:40]})
        true = issue == self.issue and amount == self.amount
        return StepResult(done=False, turn_rewards={"customer": p.clarity_reward if true else -p.misstate_penalty},
                          info={"claim": [issue, amount], "true": true})

    def _agent(self, reply: str) -> StepResult:
        p = self.params
        action = parse_action(reply, AGENT_VERBS)
        turn: dict[str, float] = {}
        info: dict[str, Any] = {"action": list(action) if action else None}
        if action is None:
            self.format_failures["agent"] += 1
            turn["agent"] = -p.format_penalty
            info["malformed"] = reply[:40]
        elif action[0] == "ask":
            turn["agent"] = -p.ask_cost
            if self.asks < p.max_asks:
                self.asks += 1
                self.to_act = "customer"
                self.customer_note = "Support: please restate the issue and the amount."
                self.agent_note = "Restated. "
                return StepResult(done=False, turn_rewards=turn, info=info)
        elif action[0] != "escalate":
            return self._close(action, "agent", turn, info)
        self.escalated = True  # asked, escalated, too many asks or malformed: the manager decides
        self.to_act = "manager"
        return StepResult(done=False, turn_rewards=turn, info={**info, "escalated": True})

    def _manager(self, reply: str) -> StepResult:
        action = parse_action(reply, MANAGER_VERBS)
        if action is None:
            self.format_failures["manager"] += 1
            return self._close(None, "manager", {"manager": -self.params.format_penalty}, {"malformed": reply[:40]})
        return self._close(action, "manager", {}, {"action": list(action)})

    def _close(self, action: tuple[str, int | None] | None, by: str, turn: dict[str, float],
               info: dict[str, Any]) -> StepResult:
        p = self.params
        self.final, self.by, self.to_act = (action if action and action[0] != "deny" else None), by, ""
        solved = p.resolve_reward if self.resolved() else 0.0
        rewards = {"customer": solved, "agent": solved, "manager": solved if self.escalated else 0.0}
        if action and action[0] == "refund":
            amount = action[1] or 0
            if amount > self.amount or (by == "agent" and amount > p.refund_cap):
                rewards[by] -= p.policy_penalty
                info["policy_broken"] = True
        if self.escalated and not self.escalation_needed():
            rewards["agent"] -= p.escalation_cost
        return StepResult(done=True, rewards=rewards, turn_rewards=turn,
                          info={**info, "resolved": self.resolved(), "by": by})

    # --- scripted players ---------------------------------------------------
    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if role == "customer":
            return {"honest": f"My issue: {self.issue}, ${self.amount}.",
                    "vague": "Something is wrong, please help.",
                    "greedy": f"My issue: {self.issue}, ${2 * self.amount}."}[player]
        if role == "agent":
            return self._scripted_agent(player)
        if player == "by_record":
            verb, amount = self.correct()
            return f"{verb} {amount}" if amount is not None else verb
        if player == "rubber_stamp":
            issue, amount = self.claim
            return f"refund {amount or self.amount}" if ISSUES.get(issue or "") == "refund" else \
                ISSUES.get(issue or "", "deny")
        if player == "deny":
            return "deny"
        raise ValueError(f"{player!r} cannot play the {role}")

    def _scripted_agent(self, player: str) -> str:
        issue, amount = self.claim
        if player == "always_escalate":
            return "escalate"
        if issue is None:
            return "ask" if self.asks < self.params.max_asks else "escalate"
        verb = ISSUES[issue]
        if verb != "refund":
            return verb
        if player == "overrefund":
            return f"refund {amount or 0}"
        if player == "by_policy":
            return "escalate" if amount is None or amount > self.params.refund_cap else f"refund {amount}"
        raise ValueError(f"{player!r} cannot play the agent")

    def summary(self) -> dict[str, Any]:
        return {"issue": self.issue, "amount": self.amount, "correct": list(self.correct()),
                "final": list(self.final) if self.final else None, "by": self.by, "resolved": self.resolved(),
                "escalated": self.escalated, "escalation_needed": self.escalation_needed(), "asks": self.asks,
                "format_failures": dict(self.format_failures)}
