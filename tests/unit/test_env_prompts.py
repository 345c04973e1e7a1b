"""Language environments a chat model can play: per-role default system messages (overridable), lenient but
honest parsing of replies (an answer inside a sentence counts; a reply with no usable answer is malformed),
and evaluations that show a win/draw/loss score only for games."""

from __future__ import annotations

import asyncio

import pytest

from services.envs.answer_then_answer import AnswerThenAnswer
from services.envs.base import EnvParamError
from services.envs.code_tasks import extract_program
from services.envs.doctor_patient import DoctorPatient, parse_action
from services.envs.explore_exploit import ExploreExploit
from services.envs.guess_number import GuessNumber, last_int
from services.envs.registry import BUILTINS, load_environment
from services.envs.support_desk import parse_action as desk_action
from services.envs.support_desk import parse_claim
from services.envs.twenty_questions import TABLE, TwentyQuestions, parse_question, yes_no
from services.play.evaluation import fmt_report

LANGUAGE = ("twenty_questions", "answer_then_answer", "debate", "doctor_patient", "support_desk", "explore_exploit",
            "guess_number", "math", "math_critic", "code", "code_critic")


def step(env, reply):  # type: ignore[no-untyped-def]
    return asyncio.run(env.step(env.current_role(), reply))


@pytest.mark.parametrize("name", LANGUAGE)
def test_every_role_of_a_language_environment_is_told_the_protocol(name: str) -> None:
    cls = load_environment(name)
    env = cls({}, 0)
    for role in cls.roles:
        text = env.system_prompt(role)
        assert text and len(text) > 40, (name, role)
    first = cls.roles[0]
    quiet = cls({"system": {first: ""}}, 0)
    assert quiet.system_prompt(first) is None  # '' : no system message (the tiny demo models)
    assert cls({"system": {first: "Be brief."}}, 0).system_prompt(first) == "Be brief."
    with pytest.raises(EnvParamError, match="system.nobody: no such role") as err:
        cls({"system": {"nobody": "x"}}, 0)
    assert err.value.field == "system.nobody"


def test_only_games_are_scored_by_win_draw_loss() -> None:
    games = {n for n in BUILTINS if load_environment(n).is_game}
    assert games == {"tictactoe", "debate", "textarena"}
    report = {"score": 0.9, "score_se": 0.1, "wins": 9, "draws": 0, "losses": 1, "illegal_rate": 0.25,
              "summary_means": {"resolved": 0.5, "asks": 0.25}, "game": False}
    assert fmt_report(report) == "resolved 0.500, asks 0.250 (illegal 0.250)"
    assert fmt_report({**report, "game": True}).startswith("0.900 ± 0.100 (w/d/l 9/0/1")


def test_twenty_questions_reads_a_question_inside_a_sentence() -> None:
    assert parse_question("Is it an animal?") == "animal"
    assert parse_question("Good question! Is it alive, or is it a rock?") == "alive"
    assert parse_question("Does it fly?") == "flies"
    assert parse_question("I think it's a cat.") == "cat"
    assert parse_question("Is it alive or metal?") == "alive"  # the first 'is it X' with X known
    assert parse_question("alive or metal") is None  # two known words, no question form: ambiguous
    assert parse_question("Is it a spaceship?") is None and parse_question("Let me think.") is None
    assert yes_no("Yes, it is.") is True and yes_no("Well... no.") is False and yes_no("maybe") is None
    env = TwentyQuestions({}, 0)
    wrong = next(o for o in sorted(TABLE) if o != env.secret)
    r = step(env, f"My guess: is it a {wrong}?")
    assert "malformed" not in r.info and r.info == {"guess": wrong}


def test_numbers_are_read_from_the_last_integer() -> None:
    env = GuessNumber({"low": 1, "high": 100}, 3)
    r = step(env, f"My guess is {env.target}.")
    assert r.done and r.rewards == {"guesser": 1.0}
    env = GuessNumber({"low": 1, "high": 100}, 3)
    assert "malformed" in step(env, "I will guess a number.").info
    assert last_int("1-16 is the range") == 16 and last_int("so x = -4.") == -4 and last_int("5-3 = 2") == 2
    assert "1 to 100" in (env.system_prompt("guesser") or "")
    env = AnswerThenAnswer({"ops": "+"}, 5)
    assert env.observation("first") == f"What is {env.question.rstrip('=')}?"
    step(env, f"{env.question.rstrip('=')} = {env.answer}")
    assert env.observation("second").endswith(f"The first player answered: {env.answer}. What is your answer?")
    r = step(env, "no idea")
    assert r.rewards == {"first": 1.0, "second": -0.5}
    assert AnswerThenAnswer({"ops": "+", "terse": True}, 5).observation("first") == env.question  # the demo's "3+4="


def test_doctor_reads_an_action_inside_a_sentence() -> None:
    assert parse_action("Let me ask about fever.") == ("ask", "fever")
    assert parse_action("Do you have a headache?") == ("ask", "headache")
    assert parse_action("My diagnosis is malaria.") == ("diagnose", "malaria")
    assert parse_action("I diagnose you with flu") == ("diagnose", "flu")
    assert parse_action("Is it flu or measles?") is None  # no diagnosis made, two named
    assert parse_action("Do you have fever or a rash?") is None  # two topics: ambiguous
    assert parse_action("what is wrong?") is None
    env = DoctorPatient({}, 0)
    r = step(env, f"Based on this, my diagnosis is {env.case['diagnosis']}.")
    assert r.done and r.rewards["doctor"] == 1.0


def test_support_desk_and_explorer_read_plain_words() -> None:
    assert parse_claim("My order arrived broken and cost $30.") == ("damaged", 30)
    assert desk_action("I will refund you $45 now.", ("refund",)) == ("refund", 45)
    assert desk_action("I can refund you. 45", ("refund",)) is None  # the amount must go with the refund
    env = ExploreExploit({"size": 5, "probes": 3}, 2)
    step(env, "I'll start with probe 0, 0 please")
    assert env.probes and env.probes[0][:2] == (0, 0)
    step(env, "OK, my report: the treasure is at 1 2")
    assert env.report == "the treasure is at 1 2" and env.current_role() == "exploiter"


def test_code_reads_a_cut_fence_and_prose_before_the_code() -> None:
    cut = "Here you go:\n```python\ndef f(x):\n    return x + 2\n"
    assert extract_program(cut) == "def f(x):\n    return x + 2\n"
    prose = "Sure. This adds two.\ndef f(x):\n    return x + 2"
    assert extract_program(prose) == "def f(x):\n    return x + 2"
    assert extract_program("```python\ndef g(x):\n    return x\n```") is None
    assert extract_program("I cannot write that.") is None
