"""Doctor and patient: a bilateral dialogue on a synthetic case (MrlX's TakesTwo pattern), offline.

Roles: ``doctor`` (A) and ``patient`` (B). A case (``CASES``, drawn from the
seed) has a hidden diagnosis and facts: for each topic of ``TOPICS`` the
patient's true answer. The patient sees the case's facts, never needs the
diagnosis name, and must not say it.

Protocol
* The doctor replies ``ask <topic>`` or ``diagnose <name>`` (one of ``DIAGNOSES``), read leniently
  (``parse_action``): either form anywhere in the reply; else a reply that speaks of a diagnosis
  ("My diagnosis is flu.") and names exactly one counts as diagnosing it, and one that names exactly one
  topic ("Do you have a fever?") as asking about it.
* After ``ask``, the patient answers in free text. Any other doctor reply costs
  the doctor the format penalty but still reaches the patient as a free-form
  question (so the patient always has turns to learn from); its answer is then
  judged only for leaks and emptiness.

Rewards
* doctor: +1 for the right diagnosis, -1 for a wrong one (either ends the
  episode), ``-turn_cost`` per question (per turn), ``-format_penalty`` for a
  reply that is neither form (it goes to the patient as a free-form question). No diagnosis after
  ``max_turns`` doctor turns: 0.
* patient, per answer: ``+answer_reward`` when it is consistent with the case
  (for a yes/no topic the first yes/no word agrees; for a detail topic the
  answer contains the fact) and complete (it answers the question asked:
  an answer with neither yes/no nor the fact is incomplete: 0);
  ``-answer_reward`` for a contradicting answer; ``-leak_penalty`` when the
  answer names the diagnosis (volunteering it); ``-format_penalty`` for an
  empty answer; 0 for an answer to a free-form question that neither leaks
  nor is empty.

Each role's default system message tells a chat model its part (``params.system`` replaces it).

Scripted players: doctor ``systematic`` (asks the topics that separate the
diagnoses still possible, then diagnoses) and ``random``; patient
``faithful`` (the case's fact), ``leaky`` (the fact plus the diagnosis) and ``liar``.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from pydantic import Field

from services.envs.base import Environment, StepResult
from services.envs.params import ChatParams, EnvParams

TOPICS = ("fever", "cough", "rash", "headache", "vomiting", "duration", "travel", "pain")
CASES: tuple[dict[str, Any], ...] = (
    {"diagnosis": "flu", "facts": {"fever": "yes", "cough": "yes", "rash": "no", "headache": "yes",
                                   "vomiting": "no", "duration": "3 days", "travel": "no", "pain": "muscles"}},
    {"diagnosis": "measles", "facts": {"fever": "yes", "cough": "yes", "rash": "yes", "headache": "no",
                                       "vomiting": "no", "duration": "5 days", "travel": "no", "pain": "none"}},
    {"diagnosis": "migraine", "facts": {"fever": "no", "cough": "no", "rash": "no", "headache": "yes",
                                        "vomiting": "yes", "duration": "1 day", "travel": "no", "pain": "head"}},
    {"diagnosis": "malaria", "facts": {"fever": "yes", "cough": "no", "rash": "no", "headache": "yes",
                                       "vomiting": "yes", "duration": "7 days", "travel": "yes", "pain": "joints"}},
    {"diagnosis": "appendicitis", "facts": {"fever": "yes", "cough": "no", "rash": "no", "headache": "no",
                                            "vomiting": "yes", "duration": "1 day", "travel": "no",
                                            "pain": "belly"}},
    {"diagnosis": "allergy", "facts": {"fever": "no", "cough": "yes", "rash": "yes", "headache": "no",
                                       "vomiting": "no", "duration": "2 weeks", "travel": "no", "pain": "none"}},
)
DIAGNOSES = tuple(c["diagnosis"] for c in CASES)
ACTION = re.compile(r"\b(ask|diagnose)\b\W*(?:about\s+|with\s+|as\s+|the\s+|a\s+)*([a-z]+)", re.IGNORECASE)
TOPIC_FORMS = {"feverish": "fever", "coughing": "cough", "rashes": "rash", "headaches": "headache",
               "vomit": "vomiting", "vomited": "vomiting", "long": "duration", "travelled": "travel",
               "traveled": "travel", "hurt": "pain", "hurts": "pain"}  # other forms of a topic


def parse_action(reply: str) -> tuple[str, str] | None:
    """("ask", topic) or ("diagnose", name) from a doctor's reply, or None (see the module's protocol)."""
    for m in ACTION.finditer(reply):
        verb, word = m.group(1).lower(), m.group(2).lower()
        if (verb == "ask" and word in TOPICS) or (verb == "diagnose" and word in DIAGNOSES):
            return verb, word
    words = re.findall(r"[a-z]+", reply.lower())
    named = {w for w in words if w in DIAGNOSES}
    if len(named) == 1 and any(w.startswith("diagnos") for w in words):
        return "diagnose", named.pop()
    topics = {TOPIC_FORMS.get(w, w) for w in words} & set(TOPICS)
    return ("ask", topics.pop()) if len(topics) == 1 and not named else None


def judge_answer(answer: str, fact: str, diagnosis: str) -> tuple[str, bool]:
    """("consistent" | "contradicts" | "incomplete" | "empty", leaked diagnosis?)"""
    words = re.findall(r"[a-z0-9]+", answer.lower())
    leaked = diagnosis in words
    if not words:
        return "empty", leaked
    if fact in ("yes", "no"):
        said = next((w for w in words if w in ("yes", "no")), None)
        return ("incomplete" if said is None else "consistent" if said == fact else "contradicts"), leaked
    if fact.lower() in " ".join(words):
        return "consistent", leaked
    others = {c["facts"][t] for c in CASES for t in TOPICS} - {"yes", "no", fact}
    return ("contradicts" if any(o in " ".join(words) for o in others) else "incomplete"), leaked


class DoctorPatientParams(ChatParams):
    max_turns: int = Field(8, ge=1, le=50, description="doctor turns")
    turn_cost: float = Field(0.05, ge=0.0, le=1.0, description="doctor, per turn")
    answer_reward: float = Field(0.2, ge=0.0, le=10.0, description="patient, per consistent answer")
    leak_penalty: float = Field(1.0, ge=0.0, le=10.0, description="patient, per answer naming the diagnosis")
    format_penalty: float = Field(0.2, ge=0.0, le=10.0)


class DoctorPatient(Environment[DoctorPatientParams]):
    roles: ClassVar[tuple[str, ...]] = ("doctor", "patient")
    description: ClassVar[str] = ("Doctor asks, patient answers from a synthetic case; doctor rewarded for a right "
                                  "diagnosis in few turns, patient for consistent, complete, non-leaking answers.")
    scripted_players: ClassVar[tuple[str, ...]] = ("systematic", "random", "faithful", "leaky", "liar")
    scripted_roles: ClassVar[dict[str, tuple[str, ...]]] = {
        "systematic": ("doctor",), "random": ("doctor",), "faithful": ("patient",), "leaky": ("patient",),
        "liar": ("patient",)}

    env_name: ClassVar[str] = "doctor_patient"
    summary_measures: ClassVar[tuple[str, ...] | None] = ("right", "doctor_turns", "consistent", "leaks")
    default_system: ClassVar[dict[str, str]] = {
        "doctor": ("You are a doctor. Find the patient's illness, one of: " + ", ".join(DIAGNOSES) + ". Each turn "
                   "reply with exactly one short line: 'ask <topic>' with one topic from: " + ", ".join(TOPICS)
                   + " (example: 'ask fever'), or, when you are sure, 'diagnose <illness>' (example: 'diagnose "
                   "flu'). Write nothing else."),
        "patient": ("You are a patient. You are told your symptoms. Answer the doctor's question about one of them "
                    "in a few words, truthfully: start with yes or no for a yes/no symptom, or give the detail "
                    "(how long, where it hurts). Do not guess the name of your illness."),
    }

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        self.case = self.rng.choice(CASES)
        self.to_act = "doctor"
        self.doctor_turns = 0
        self.topic: str | None = None
        self.doctor_note = f"Diagnose: {' '.join(DIAGNOSES)}. Say 'ask <topic>' ({' '.join(TOPICS)}) or " \
                           "'diagnose <name>'."
        self.patient_note = "You are the patient. " + ", ".join(f"{t}: {v}" for t, v in self.case["facts"].items())
        self.answers: dict[str, str] = {}  # topic -> what the patient's answer said (for the scripted doctor)
        self.diagnosis: str | None = None
        self.verdicts: list[str] = []
        self.leaks = 0
        self.briefed = False  # the patient sees the case's facts with the first question

    def current_role(self) -> str:
        return self.to_act

    def observation(self, role: str) -> str:
        return self.doctor_note if role == "doctor" else self.patient_note

    async def step(self, role: str, reply: str) -> StepResult:
        p = self.params
        self.check_turn(role)
        if role == "patient":
            said = " ".join(reply.split())[:60] or "(no answer)"
            if self.topic is None:  # a free-form question: only leaks and empty answers can be judged
                leaked = self.case["diagnosis"] in re.findall(r"[a-z0-9]+", reply.lower())
                verdict = "empty" if not reply.strip() else "unchecked"
                self.doctor_note = f"Say 'ask <topic>' or 'diagnose <name>'. Patient: {said}"
            else:
                verdict, leaked = judge_answer(reply, self.case["facts"][self.topic], self.case["diagnosis"])
                self.answers[self.topic] = reply
                self.doctor_note = f"{self.topic}: {said}"
            self.verdicts.append(verdict)
            self.leaks += leaked
            r = {"consistent": p.answer_reward, "contradicts": -p.answer_reward, "incomplete": 0.0,
                 "unchecked": 0.0, "empty": -p.format_penalty}[verdict] - (p.leak_penalty if leaked else 0.0)
            self.to_act = "doctor"
            info = {"verdict": verdict, "leaked": leaked} | ({"malformed": ""} if verdict == "empty" else {})
            return self.turn_result({"patient": r}, info, out_of_turns=self.doctor_turns >= p.max_turns)
        self.doctor_turns += 1
        verb, word = parse_action(reply) or ("", "")
        if verb == "diagnose" and word in DIAGNOSES:
            self.diagnosis = word
            right = word == self.case["diagnosis"]
            return StepResult(done=True, rewards={"doctor": 1.0 if right else -1.0, "patient": 0.0},
                              info={"diagnosis": word, "right": right})
        well_formed = verb == "ask" and word in TOPICS
        self.topic = word if well_formed else None
        question = f"{word}?" if well_formed else " ".join(reply.split())[:80] or "..."
        cost = {"doctor": -p.turn_cost - (0.0 if well_formed else p.format_penalty)}
        info: dict[str, Any] = {"ask": word} if well_formed else {"malformed": reply[:40]}
        if not well_formed and self.doctor_turns >= p.max_turns:
            return self.turn_result(cost, info, out_of_turns=True)
        self.to_act = "patient"  # a malformed reply still reaches the patient, as a free-form question
        self.patient_note = (self.patient_note + "\n" if not self.briefed else "") + f"Doctor: {question}"
        self.briefed = True
        return self.turn_result(cost, info)

    def _possible(self) -> list[dict[str, Any]]:
        out = []
        for case in CASES:
            if all(judge_answer(a, case["facts"][t], "")[0] == "consistent" for t, a in self.answers.items()):
                out.append(case)
        return out or list(CASES)

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if role == "patient":
            fact = self.case["facts"][self.topic or TOPICS[0]]
            if player == "faithful":
                return fact
            if player == "leaky":
                return f"{fact}, I think it is {self.case['diagnosis']}"
            if player == "liar":
                return {"yes": "no", "no": "yes"}.get(fact, "none")
            raise ValueError(f"{player!r} cannot play the patient")
        if player == "random":
            return rng.choice([f"ask {rng.choice(TOPICS)}", f"diagnose {rng.choice(DIAGNOSES)}"])
        possible = self._possible()
        if len(possible) == 1:
            return f"diagnose {possible[0]['diagnosis']}"
        asked = [t for t in TOPICS if t not in self.answers and len({c["facts"][t] for c in possible}) > 1]
        return f"ask {asked[0]}" if asked else f"diagnose {possible[0]['diagnosis']}"

    def summary(self) -> dict[str, Any]:
        return {"case": self.case["diagnosis"], "diagnosis": self.diagnosis, "doctor_turns": self.doctor_turns,
                "answers": self.verdicts, "leaks": self.leaks, "right": int(self.diagnosis == self.case["diagnosis"]),
                "consistent": self.verdicts.count("consistent")}
