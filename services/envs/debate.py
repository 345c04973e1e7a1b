"""Debate: two sides argue a motion over ``rounds`` turns each; a judge gives the verdict.

Roles: ``pro``, ``con`` and ``judge``. The judge is a role like any other: map
it to ``scripted:rules`` for the rule-based judge below, or to an agent
(usually a frozen one, ``train: false``) for a model judge.

* Motions (``MOTIONS``) come with the evidence words each side can use.
* Debaters reply with one argument (at most ``max_chars`` characters; the
  judge sees the first ``max_chars``). An empty argument is malformed:
  ``-format_penalty`` for that side (per turn), and the debate goes on.
* The judge sees the motion and the transcript and replies ``PRO``, ``CON``
  or ``TIE`` (the first of these words in the reply counts).
* The rule-based judge (``scripted:rules``) scores each side by the distinct
  evidence words of its side that its arguments use; more wins, equal ties.

Rewards are zero-sum from the verdict: winner +1, loser -1, tie 0 each. An
unparseable verdict counts as a tie, and the judge gets ``-format_penalty``
(the judge is not otherwise rewarded).

Each role's default system message tells a chat model its part (``params.system`` replaces it).

Scripted players: ``rules`` (judge), ``evidence`` (a debater citing its side's
evidence words, one more per round), ``silent`` (an empty argument).
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from pydantic import Field

from services.envs.base import Environment, StepResult
from services.envs.params import ChatParams, EnvParams

MOTIONS: tuple[dict[str, Any], ...] = (
    {"motion": "cities should ban cars", "pro": ("air", "safety", "noise", "space", "transit"),
     "con": ("jobs", "freedom", "cost", "rural", "delivery")},
    {"motion": "homework should be abolished", "pro": ("stress", "sleep", "play", "family", "equity"),
     "con": ("practice", "habits", "memory", "grades", "discipline")},
    {"motion": "space exploration is worth it", "pro": ("science", "tech", "future", "inspire", "resources"),
     "con": ("poverty", "risk", "waste", "earth", "debt")},
)
VERDICT = re.compile(r"\b(pro|con|tie)\b", re.IGNORECASE)


def count_evidence(arguments: list[str], words: tuple[str, ...]) -> int:
    text = set(re.findall(r"[a-z]+", " ".join(arguments).lower()))
    return sum(1 for w in words if w in text)


class DebateParams(ChatParams):
    rounds: int = Field(2, ge=1, le=10, description="arguments per side")
    max_chars: int = Field(200, ge=1, le=10000, description="an argument is cut to this length")
    format_penalty: float = Field(0.5, ge=0.0, le=10.0)


class Debate(Environment[DebateParams]):
    roles: ClassVar[tuple[str, ...]] = ("pro", "con", "judge")
    description: ClassVar[str] = ("Debate: pro and con argue a motion for k rounds; a judge (rule-based or an "
                                  "agent) picks the winner; zero-sum +1/-1.")
    scripted_players: ClassVar[tuple[str, ...]] = ("rules", "evidence", "silent")
    scripted_roles: ClassVar[dict[str, tuple[str, ...]]] = {
        "rules": ("judge",), "evidence": ("pro", "con"), "silent": ("pro", "con")}

    env_name: ClassVar[str] = "debate"
    is_game: ClassVar[bool] = True  # zero-sum: the verdict is a win, a tie or a loss
    default_system: ClassVar[dict[str, str]] = {
        side: (f"You are in a debate and argue {side.upper()} the motion you are given. Each turn, reply with one "
               "short argument of one or two sentences that uses concrete reasons (for example costs, safety, "
               "health, jobs, the future). Do not argue for the other side.")
        for side in ("pro", "con")} | {
        "judge": ("You judge a debate. Read the motion and the arguments, then reply with one word: PRO if the "
                  "side for the motion argued better, CON if the side against it did, TIE if neither."),
    }

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        self.topic = self.rng.choice(MOTIONS)
        self.arguments: dict[str, list[str]] = {"pro": [], "con": []}
        self.order = ["pro", "con"] * self.params.rounds + ["judge"]
        self.turn = 0
        self.verdict: str | None = None
        self.seen = {"pro": 0, "con": 0}  # transcript lines each side has seen (up to its own last)


    def current_role(self) -> str:
        return self.order[self.turn]

    def _transcript(self) -> list[str]:
        out = []
        for i in range(max(len(self.arguments["pro"]), len(self.arguments["con"]))):
            for side in ("pro", "con"):
                if i < len(self.arguments[side]):
                    out.append(f"{side.upper()}: {self.arguments[side][i]}")
        return out

    def observation(self, role: str) -> str:
        lines = self._transcript()
        if role == "judge":
            return f"Motion: {self.topic['motion']}.\n" + "\n".join(lines) + "\nVerdict: PRO, CON or TIE?"
        head = f"Motion: {self.topic['motion']}. You argue {role.upper()}.\n" if not self.arguments[role] else ""
        new = lines[self.seen[role]:]
        return head + "\n".join(new) + ("\n" if new else "") + "Your argument:"

    def rule_verdict(self) -> str:
        pro = count_evidence(self.arguments["pro"], self.topic["pro"])
        con = count_evidence(self.arguments["con"], self.topic["con"])
        return "pro" if pro > con else "con" if con > pro else "tie"

    async def step(self, role: str, reply: str) -> StepResult:
        self.check_turn(role)
        self.turn += 1
        if role != "judge":
            arg = " ".join(reply.split())[: self.params.max_chars]
            self.arguments[role].append(arg)
            self.seen[role] = len(self._transcript())
            if not arg:
                return StepResult(done=False, turn_rewards={role: -self.params.format_penalty},
                                  info={"malformed": "empty argument"})
            return StepResult(done=False)
        m = VERDICT.search(reply)
        self.verdict = m.group(1).lower() if m else "tie"
        judge = 0.0 if m else -self.params.format_penalty
        win = {"pro": 1.0, "con": -1.0} if self.verdict == "pro" else {"pro": -1.0, "con": 1.0} \
            if self.verdict == "con" else {"pro": 0.0, "con": 0.0}
        return StepResult(done=True, rewards={**win, "judge": judge},
                          info={"verdict": self.verdict, "parsed": bool(m)} | ({} if m else {"malformed": reply[:40]}))

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if player == "rules":
            return self.rule_verdict().upper()
        if player == "evidence":
            n = len(self.arguments[role]) + 1
            return f"Consider {' and '.join(self.topic[role][:n])}."
        if player == "silent":
            return ""
        raise ValueError(f"unknown scripted player {player!r}; choose from {self.scripted_players}")

    def summary(self) -> dict[str, Any]:
        return {"motion": self.topic["motion"], "verdict": self.verdict, "arguments": self.arguments,
                "rule_verdict": self.rule_verdict()}
