"""Twenty questions for chat models: the objects named per episode (``choices``), the environment's opening
clues (``clue``), repeated questions counted, and held-out objects kept out of training's choices."""

from __future__ import annotations

import asyncio
import random

from services.envs.twenty_questions import ATTRIBUTES, TABLE, TwentyQuestions, splitting_attribute

PARAMS = {"choices": 4, "clue": True, "max_questions": 3, "held_out": 0.25}


def test_every_object_has_its_own_attributes() -> None:
    rows = {tuple(sorted(a for a in ATTRIBUTES if TABLE[o][a])) for o in TABLE}
    assert len(rows) == len(TABLE) == 24  # the halving asker can tell every object apart


def test_choices_name_the_secret_among_objects_of_the_split_only() -> None:
    evaluated = TwentyQuestions.evaluation_params(PARAMS)
    held = {o for seed in range(200) for o in TwentyQuestions(evaluated, seed).choices}
    for seed in range(200):
        env = TwentyQuestions(PARAMS, seed)
        assert len(env.choices) == 4 and env.secret in env.choices and not set(env.choices) & held
        assert ", ".join(env.choices) in env.system_prompt("asker")
    assert TwentyQuestions({"choices": 0}, 0).choices == sorted(TABLE)


def test_the_clue_is_answered_first_and_costs_no_question() -> None:
    env = TwentyQuestions(PARAMS, 3)
    clue = splitting_attribute(sorted(env.choices))
    assert env.current_role() == "answerer" and f"Question: Is it {clue}?" in env.observation("answerer")
    truth = TABLE[env.secret][clue]
    result = asyncio.run(env.step("answerer", "Yes" if truth else "No"))
    assert result.turn_rewards == {"answerer": 0.1} and not result.done
    assert env.current_role() == "asker" and env.questions == 0
    note = env.observation("asker")
    assert note.startswith(f"Objects: {', '.join(env.choices)}. A clue: Is it {clue}? {'Yes' if truth else 'No'}.")


def test_two_clues_follow_the_table_not_the_answerer_and_the_asker_hears_both() -> None:
    for seed in range(40):
        env = TwentyQuestions({**PARAMS, "clue": 2, "notes": True}, seed)
        first = splitting_attribute(sorted(env.choices))
        left = [o for o in sorted(env.choices) if TABLE[o][first] == TABLE[env.secret][first]]
        assert env.clues == [first] + ([second] if (second := splitting_attribute(left)) else [])
        answers = []
        for clue in list(env.clues):  # a lie to every clue: the second clue stays the table's, so a group shares it
            assert env.current_role() == "answerer" and f"Question: Is it {clue}?" in env.observation("answerer")
            lie = "no" if TABLE[env.secret][clue] else "yes"
            result = asyncio.run(env.step("answerer", lie))
            assert result.turn_rewards == {"answerer": -0.1} and not result.done
            answers.append(f"Is it {clue}? {lie.capitalize()}.")
        assert env.current_role() == "asker" and env.questions == 0
        said = "A clue" if len(answers) == 1 else "Clues"
        assert env.observation("asker") == (f"Objects: {', '.join(env.choices)}. {said}: {' '.join(answers)} "
                                            "Ask your next question, or guess.")


def test_a_repeated_question_is_counted_and_a_distinct_guesser_finds_within_three() -> None:
    env = TwentyQuestions({**PARAMS, "clue": False}, 5)
    wrong = next(o for o in env.choices if o != env.secret)
    for _ in range(2):
        asyncio.run(env.step("asker", f"Is it a {wrong}?"))
    assert env.summary()["repeats"] == 1 and env.observation("asker").startswith(f"No, it is not the {wrong}.")
    found = 0
    for seed in range(100):
        env = TwentyQuestions({**PARAMS, "clue": False}, seed)
        for guess in random.Random(seed).sample(env.choices, 3):
            result = asyncio.run(env.step("asker", f"Is it a {guess}?"))
            if result.done:
                break
        found += env.found
    assert 60 <= found <= 90  # three distinct guesses of four: found three times in four


def test_halving_with_a_truthful_clue_finds_every_secret() -> None:
    rng = random.Random(0)
    for seed in range(60):
        env = TwentyQuestions({**PARAMS, "max_questions": 5}, seed)
        for _ in range(20):
            role = env.current_role()
            result = asyncio.run(env.step(role, env.scripted_reply(role, "halving" if role == "asker" else
                                                                   "truthful", rng)))
            if result.done:
                break
        assert env.found and env.lies == 0, env.summary()


def test_facts_tell_the_answerer_the_secret_row_and_answering_from_them_is_truthful() -> None:
    import re

    from services.envs.twenty_questions import yes_no

    for seed in range(60):
        env = TwentyQuestions({**PARAMS, "facts": True}, seed)
        note = env.observation("answerer")
        told = set(re.findall(r"It is ([a-z]+)\.", note)) - {"nothing"}
        assert told == {a for a in ATTRIBUTES if TABLE[env.secret][a]}, note
        assert ("It is nothing else." in note) == bool(told)
        assert "as its facts say" in (env.system_prompt("answerer") or "")
        asked = env.pending
        reply = "Yes." if asked in told else "No, it is not."
        asyncio.run(env.step("answerer", reply))
        assert env.truthful == 1 and env.lies == 0 and yes_no(reply) == TABLE[env.secret][asked]
    assert "It is" not in TwentyQuestions(PARAMS, 0).observation("answerer").split("Question")[0].replace(
        "The secret object is", "")


def test_notes_give_each_question_its_answer_and_answering_as_they_say_is_truthful() -> None:
    import re

    for seed in range(40):
        env = TwentyQuestions({**PARAMS, "notes": True}, seed)
        assert "as your note says" in (env.system_prompt("answerer") or "")
        done = False
        while not done and env.current_role() == "answerer":
            note = env.observation("answerer")
            attribute, said = re.findall(r"Your note: ([a-z]+): (yes|no)\.", note)[-1]
            assert attribute == env.pending and (said == "yes") == TABLE[env.secret][attribute], note
            done = asyncio.run(env.step("answerer", f"{said.capitalize()}.")).done
            if not done:  # the asker asks the attribute that splits what is left (or guesses: the episode ends)
                done = asyncio.run(env.step("asker", env.scripted_reply("asker", "halving", random.Random(0)))).done
        assert env.lies == 0 and env.truthful >= 1, env.summary()
    assert "Your note" not in TwentyQuestions(PARAMS, 0).observation("answerer")
