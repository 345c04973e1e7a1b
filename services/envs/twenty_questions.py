"""Twenty questions: an asker finds a hidden object by yes/no questions an answerer agent answers.

Roles: ``asker`` (A) and ``answerer`` (B; trained, frozen or scripted by the
config). The hidden object is drawn from the seed out of ``TABLE``, the
attribute table shipped here, which is also what every answer is checked against.

Protocol
* The asker replies ``is it <attribute>?`` (an attribute of the table) or
  ``is it <object>?`` (a guess). Guesses are settled by the environment: a
  right one ends the episode; a wrong one is answered "no" and costs a question.
  Read leniently (``parse_question``): the first ``is it X`` in the reply whose X is
  known, else the one attribute or object the reply names (a reply naming none, or
  several, is malformed).
* Attribute questions go to the answerer, who sees the secret object and must
  reply ``yes`` or ``no`` (the first of those words in the reply counts). The asker then sees the answer.
  With ``facts`` the answerer is also told the object's row of the table (the attributes it has, "nothing
  else" for the rest): the table is this game's truth, which a model's own knowledge need not share (a kite
  is red here), so answering becomes reading the facts, a skill that carries to objects never trained on.
  With ``notes`` each question comes with the table's answer to it ("Your note: red: no."), so answering is
  reading one fact.
* With ``clue`` the environment first asks the answerer that many questions, each the attribute that best
  splits the objects the table's earlier answers leave (so a group's episodes share them); the asker
  starts from the answers, which cost it no question.
Each role's default system message (``default_system``) tells a chat model this protocol.

Rewards
* asker: +1 for naming the object (final); ``-question_cost`` per question
  (per turn); ``-format_penalty`` for a reply that is neither form (the turn is
  lost, the asker asks again).
* answerer: ``+truth_reward`` per answer that agrees with the table,
  ``-truth_reward`` per answer that does not, ``-format_penalty`` (and the
  asker is told "no answer") for a reply that is neither yes nor no.
After ``max_questions`` questions the episode ends; the asker gets no bonus.
``held_out`` keeps a share of the objects (by a hash of the name) secret in evaluations only.

Scripted players: asker ``halving`` (the attribute that best splits the
objects still possible, then a guess) and ``random``; answerer ``truthful``,
``liar`` and ``random``.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from pydantic import Field, field_validator

from services.envs.base import Environment, StepResult
from services.envs.params import ChatParams, EnvParams, HeldOutParams, split_cases

ATTRIBUTES = ("alive", "animal", "edible", "metal", "big", "wild", "flies", "swims", "red", "electric")
_ROWS = {  # object: attributes that are true; every other attribute is false
    "cat": {"alive", "animal"},
    "eagle": {"alive", "animal", "wild", "flies"},
    "shark": {"alive", "animal", "wild", "swims", "big"},
    "apple": {"alive", "edible", "red"},
    "carrot": {"alive", "edible"},
    "fox": {"alive", "animal", "wild", "red"},
    "car": {"metal", "big", "electric"},
    "spoon": {"metal"},
    "phone": {"metal", "electric"},
    "boat": {"big", "swims"},
    "kite": {"flies", "red"},
    "submarine": {"metal", "big", "swims", "electric"},
    "cow": {"alive", "animal", "big"},
    "duck": {"alive", "animal", "flies", "swims"},
    "frog": {"alive", "animal", "wild", "swims"},
    "elephant": {"alive", "animal", "wild", "big"},
    "rose": {"alive", "red"},
    "tree": {"alive", "big"},
    "bread": {"edible"},
    "plane": {"metal", "big", "flies"},
    "truck": {"metal", "big"},
    "drone": {"metal", "flies", "electric"},
    "lamp": {"electric"},
    "chair": set(),
}
TABLE: dict[str, dict[str, bool]] = {o: {a: a in s for a in ATTRIBUTES} for o, s in _ROWS.items()}
QUESTION = re.compile(r"\bis it (?:an? |the )?([a-z]+)", re.IGNORECASE)
ALIASES = {"fly": "flies", "flying": "flies", "swim": "swims", "swimming": "swims", "living": "alive",
           "metallic": "metal", "large": "big", "animals": "animal"}  # other forms of an attribute
NEXT = "Ask your next question, or guess."  # ends every note to the asker
KNOWN = frozenset(ATTRIBUTES) | frozenset(TABLE)


def _known(word: str) -> str | None:
    word = ALIASES.get(word.lower(), word.lower())
    return word if word in KNOWN else None


def parse_question(reply: str) -> str | None:
    """The attribute or object a question asks about: the first ``is it X`` with X known, else the only known
    word the reply names; None when it names none or several."""
    for m in QUESTION.finditer(reply):
        if (word := _known(m.group(1))) is not None:
            return word
    named = {w for w in map(_known, re.findall(r"[a-z]+", reply.lower())) if w is not None}
    return named.pop() if len(named) == 1 else None


def yes_no(reply: str) -> bool | None:
    """The first yes or no word of the reply; None when it has neither."""
    words = re.findall(r"[a-z]+", reply.lower())
    said = next((w for w in words if w in ("yes", "no")), None)
    return None if said is None else said == "yes"


def splitting_attribute(objects: list[str]) -> str | None:
    """The attribute that splits ``objects`` most evenly (the first by name among equals); None when none
    separates them."""
    split = min(ATTRIBUTES, key=lambda a: (abs(sum(TABLE[o][a] for o in objects) * 2 - len(objects)), a))
    return None if sum(TABLE[o][split] for o in objects) in (0, len(objects)) else split


def secrets(held_out: float, split: str) -> list[str]:
    """The objects hidden in ``split``'s episodes: all of them, or with ``held_out`` those held out (``eval``)
    or the rest (``train``)."""
    objects = sorted(TABLE)
    return split_cases(objects, objects, held_out, split) if held_out else objects


class TwentyQuestionsParams(ChatParams, HeldOutParams):
    max_questions: int = Field(20, ge=1, le=100)
    question_cost: float = Field(0.02, ge=0.0, le=1.0, description="asker, per question")
    truth_reward: float = Field(0.1, ge=0.0, le=10.0, description="answerer, + per true answer, - per lie")
    format_penalty: float = Field(0.2, ge=0.0, le=10.0)
    choices: int = Field(0, ge=0, le=len(TABLE), description="objects the asker is told the secret is among, "
                         "drawn per episode from the split's objects (the secret one of them); 0: every object")
    facts: bool = Field(False, description="the answerer is told the secret object's attributes from the table "
                        "(those it has; 'nothing else' for the rest) and asked to answer as they say")
    notes: bool = Field(False, description="each question to the answerer comes with the table's answer to it as a "
                        "note ('Your note: red: no.'): answering becomes reading one fact")
    clue: int = Field(0, ge=0, le=3, description="clue questions the environment asks the answerer before the asker's "
                      "first turn (true counts as 1): each the attribute that best splits the objects the table's "
                      "earlier answers leave, the same for every episode of a group; the asker starts from the "
                      "answers (they cost it no question)")

    @field_validator("clue", mode="before")
    @classmethod
    def clue_count(cls, value: object) -> object:
        """``clue: true`` (how configs wrote one clue) is one clue; ``false`` none."""
        return int(value) if isinstance(value, bool) else value

    def check_splits(self) -> None:
        for split in ("train", "eval"):
            secrets(self.held_out, split)


class TwentyQuestions(Environment[TwentyQuestionsParams]):
    roles: ClassVar[tuple[str, ...]] = ("asker", "answerer")
    description: ClassVar[str] = ("Twenty questions: the asker names a hidden object by yes/no questions; the "
                                  "answerer's answers are checked against the attribute table.")
    scripted_players: ClassVar[tuple[str, ...]] = ("halving", "random", "truthful", "liar")
    scripted_roles: ClassVar[dict[str, tuple[str, ...]]] = {
        "halving": ("asker",), "truthful": ("answerer",), "liar": ("answerer",)}

    env_name: ClassVar[str] = "twenty_questions"
    summary_measures: ClassVar[tuple[str, ...] | None] = ("found", "questions", "truthful", "lies", "malformed",
                                                                  "repeats")
    default_system: ClassVar[dict[str, str]] = {
        "asker": ("We play twenty questions. I am thinking of one of these objects: " + ", ".join(sorted(TABLE))
                  + ". Find it by asking yes/no questions about these attributes: " + ", ".join(ATTRIBUTES)
                  + ". Each reply must be one short question of the form 'Is it <word>?', where <word> is one "
                  "attribute or, to guess, one object. Example: 'Is it alive?' or 'Is it a cat?'. Write nothing "
                  "else."),
        "answerer": ("We play twenty questions. You know the secret object. Answer each question about it "
                     "truthfully with one word: 'yes' or 'no'. Write nothing else."),
    }

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        objects = secrets(self.params.held_out, self.params.split)
        self.secret = self.rng.choice(objects)
        self.choices = self._draw_choices(objects) if self.params.choices else sorted(TABLE)
        self.to_act = "asker"
        self.questions = 0
        self.pending: str | None = None  # the attribute the answerer is asked about
        self.intro = f"Objects: {', '.join(self.choices)}."
        self.asker_note = f"{self.intro} Ask your first question, like 'Is it alive?' or 'Is it a {self.choices[0]}?'."
        self.answerer_note = f"The secret object is: {self.secret}." + (self._facts() if self.params.facts else "")
        self.candidates = sorted(self.choices)  # what truthful answers so far allow (scripted asker)
        self.found = False
        self.truthful = self.lies = self.malformed = self.repeats = 0
        self.asked: set[str] = set()  # the attributes and objects asked about so far
        self.clues = self._clues()  # asked before the asker's first turn
        self.clue_notes: list[str] = []  # the answers to them, as the asker is told them
        if self.clues:
            self.pending, self.to_act = self.clues[0], "answerer"
            self.answerer_note += " " + self._question(self.clues[0])

    def _clues(self) -> list[str]:
        """Up to ``clue`` attributes, each splitting best the choices that the table's answers to the earlier ones
        leave: fixed by the episode's seed, not by the answerer's replies, so a group shares them."""
        clues: list[str] = []
        left = sorted(self.choices)
        while len(clues) < self.params.clue and (split := splitting_attribute(left)):
            clues.append(split)
            left = [o for o in left if TABLE[o][split] == TABLE[self.secret][split]]
        return clues

    def _draw_choices(self, objects: list[str]) -> list[str]:
        """``choices`` objects of the split (all of them when it holds fewer), the secret among them, shuffled."""
        others = [o for o in objects if o != self.secret]
        drawn = self.rng.sample(others, min(self.params.choices, len(objects)) - 1) + [self.secret]
        self.rng.shuffle(drawn)
        return drawn

    def _question(self, attribute: str) -> str:
        """A question to the answerer; under ``notes`` with the table's answer as its note."""
        truth = "yes" if TABLE[self.secret][attribute] else "no"
        note = f" Your note: {attribute}: {truth}." if self.params.notes else ""
        return f"Question: Is it {attribute}?{note} Answer yes or no."

    def _facts(self) -> str:
        """The secret object's row of the table, as the answerer is told it under ``facts``."""
        has = [a for a in ATTRIBUTES if TABLE[self.secret][a]]
        return "".join(f" It is {a}." for a in has) + (" It is nothing else." if has else " It is none of: "
                                                         + ", ".join(ATTRIBUTES) + ".")

    def default_system_prompt(self, role: str) -> str:
        """The asker's names this episode's objects when ``choices`` draws them; under ``notes`` (or ``facts``)
        the answerer's says to answer as the notes (or the facts) say."""
        if role == "answerer" and self.params.notes:
            return ("We play twenty questions. You know the secret object. Each question comes with your note of "
                    "its answer. Answer with one word, 'yes' or 'no', as your note says. Write nothing else.")
        if role == "answerer" and self.params.facts:
            return ("We play twenty questions. You know the secret object and its facts. Answer each question "
                    "about it with one word, 'yes' or 'no', as its facts say. Write nothing else.")
        if role != "asker" or not self.params.choices:
            return super().default_system_prompt(role)
        return ("We play twenty questions. I am thinking of one of these objects: " + ", ".join(self.choices)
                + ". Find it by asking yes/no questions about these attributes: " + ", ".join(ATTRIBUTES)
                + ". Each reply must be one short question of the form 'Is it <word>?', where <word> is one "
                "attribute or, to guess, one of the objects. Example: 'Is it alive?' or 'Is it a "
                + self.choices[0] + "?'. Write nothing else.")

    def current_role(self) -> str:
        return self.to_act

    def observation(self, role: str) -> str:
        note = self.asker_note if role == "asker" else self.answerer_note
        return note

    def _asked(self, turn: dict[str, float], info: dict[str, Any]) -> StepResult:
        if self.clues:  # the environment's clues cost the asker no question
            self.clues.pop(0)
            self.clue_notes.append(self.asker_note.removesuffix(" " + NEXT))
            if self.clues:
                self.pending, self.to_act = self.clues[0], "answerer"
                self.answerer_note = self._question(self.clues[0])
            else:
                said = "A clue" if len(self.clue_notes) == 1 else "Clues"
                self.asker_note = f"{self.intro} {said}: {' '.join(self.clue_notes)} {NEXT}"
            return self.turn_result(turn, info)
        self.questions += 1
        return self.turn_result(turn, info, out_of_turns=self.questions >= self.params.max_questions)

    async def step(self, role: str, reply: str) -> StepResult:
        p = self.params
        self.check_turn(role)
        if role == "answerer":
            assert self.pending is not None
            said, truth = yes_no(reply), TABLE[self.secret][self.pending]
            self.to_act = "asker"
            if said is None:
                self.malformed += 1
                self.asker_note = f"Is it {self.pending}? The answerer did not say. {NEXT}"
                return self._asked({"answerer": -p.format_penalty}, {"malformed": reply[:40]})
            ok = said == truth
            self.truthful += ok
            self.lies += not ok
            self.candidates = [o for o in self.candidates if TABLE[o][self.pending] == said]
            self.asker_note = f"Is it {self.pending}? {'Yes' if said else 'No'}. {NEXT}"
            self.answerer_note = ""
            return self._asked({"answerer": p.truth_reward if ok else -p.truth_reward}, {"truthful": ok})
        word = parse_question(reply) or ""
        cost = {"asker": -p.question_cost}
        if word:
            self.repeats += word in self.asked
            self.asked.add(word)
        if word in TABLE:
            if word == self.secret:
                self.found = True
                return StepResult(done=True, rewards={"asker": 1.0, "answerer": 0.0}, turn_rewards=cost,
                                  info={"guess": word})
            self.candidates = [o for o in self.candidates if o != word]
            self.asker_note = f"No, it is not the {word}. {NEXT}"
            return self._asked(cost, {"guess": word})
        if word in ATTRIBUTES:
            self.pending = word
            self.to_act = "answerer"
            self.answerer_note = (self.answerer_note + " " if self.answerer_note else "") + self._question(word)
            return StepResult(done=False, turn_rewards=cost, info={"question": word})
        self.malformed += 1
        self.asker_note = f"That is not a question of the form 'Is it <word>?'. {NEXT}"
        return self._asked({"asker": cost["asker"] - p.format_penalty}, {"malformed": reply[:40]})

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if role == "answerer":
            truth = TABLE[self.secret][self.pending or ATTRIBUTES[0]]
            if player == "truthful":
                return "yes" if truth else "no"
            if player == "liar":
                return "no" if truth else "yes"
            return rng.choice(["yes", "no"])
        if player == "random":
            return f"is it {rng.choice(ATTRIBUTES + tuple(sorted(TABLE)))}?"
        cands = self.candidates or sorted(TABLE)
        split = splitting_attribute(cands)
        return f"is it {split}?" if split else f"is it {cands[0]}?"  # no attribute separates them: guess

    def summary(self) -> dict[str, Any]:
        return {"secret": self.secret, "found": self.found, "questions": self.questions,
                "truthful": self.truthful, "lies": self.lies, "malformed": self.malformed, "repeats": self.repeats}
