"""Built-in environments with scripted players (no model): rules, rewards, malformed replies, params."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.contracts.config import EnvironmentConfig
from services.envs.answer_then_answer import AnswerThenAnswer
from services.envs.base import Environment, EnvParamError, EnvParams, StepResult
from services.envs.code_tasks import Code, CodeCritic, extract_program
from services.envs.debate import Debate
from services.envs.doctor_patient import CASES, DoctorPatient, judge_answer
from services.envs.guess_number import GuessNumber, bits_shortfall, expected_bits
from services.envs.math_tasks import Math, MathCritic
from services.envs.params import unshaped
from services.envs.registry import BUILTINS, check_environment_config, describe_environments, load_environment
from services.envs.textarena_adapter import TextArena
from services.envs.twenty_questions import TABLE, TwentyQuestions


def step(env: Environment, reply: str) -> StepResult:
    return asyncio.run(env.step(env.current_role(), reply))


def play(env: Environment, players: dict[str, str], seed: int = 0, limit: int = 200) -> tuple[StepResult, dict]:
    """Scripted players until the end; returns the last result and the summed per-turn rewards."""
    rng, turns = random.Random(seed), {}
    for _ in range(limit):
        role = env.current_role()
        result = step(env, env.scripted_reply(role, players[role], rng))
        for r, v in result.turn_rewards.items():
            turns[r] = turns.get(r, 0.0) + v
        if result.done:
            return result, turns
    raise AssertionError("episode did not end")


# --- guess the number -------------------------------------------------------------
def test_guess_number_bisect_finds_it_and_pays_per_turn() -> None:
    for seed in range(20):
        env = GuessNumber({"low": 1, "high": 16, "max_turns": 6}, seed)
        result, turns = play(env, {"guesser": "bisect"})
        assert result.rewards == {"guesser": 1.0} and env.summary()["found"]
        assert turns["guesser"] == pytest.approx(-0.05 * env.turns)
        assert env.turns <= 5  # binary search over 16 numbers


def test_guess_number_feedback_and_malformed_reply() -> None:
    env = GuessNumber({}, 3)
    target = env.target
    assert "1-16" in env.observation("guesser")
    low = step(env, str(max(1, target - 1)) if target > 1 else "2")
    assert not low.done
    assert env.observation("guesser").endswith(("too low.", "too high."))
    bad = step(env, "seven")
    assert not bad.done and bad.turn_rewards == {"guesser": pytest.approx(-0.25)}
    assert env.observation("guesser").startswith("Reply with one integer")
    assert step(env, "99").turn_rewards["guesser"] == pytest.approx(-0.25)  # out of range: malformed too
    assert step(env, f" {target}\n").rewards == {"guesser": 1.0}


def test_guess_number_expected_bits_and_shortfall() -> None:
    assert expected_bits(1, 3, 2) == pytest.approx(1.5849625)  # three equally likely answers: log2 3
    assert expected_bits(1, 2, 1) == pytest.approx(1.0)
    assert expected_bits(5, 5, 5) == 0.0 and expected_bits(1, 10, 11) == 0.0 and expected_bits(3, 2, 3) == 0.0
    assert bits_shortfall(1, 100, 50) == 0.0 and bits_shortfall(1, 100, 51) == pytest.approx(0.0, abs=1e-3)
    assert bits_shortfall(1, 100, 1) == pytest.approx(expected_bits(1, 100, 50) - expected_bits(1, 100, 1))
    assert 0.9 < bits_shortfall(1, 100, 1) < 1.1  # an end of a wide range: about a bit lost
    assert bits_shortfall(51, 100, 20) == pytest.approx(expected_bits(51, 100, 75))  # already excluded: all lost
    shortfalls = [bits_shortfall(1, 100, g) for g in range(1, 51)]
    assert shortfalls == sorted(shortfalls, reverse=True)  # the nearer the midpoint, the less lost


def test_guess_number_info_shaping_pays_per_turn_by_the_bits_lost() -> None:
    params = {"low": 1, "high": 100, "max_turns": 16, "info_shaping": 0.5}
    env = GuessNumber(params, 4)
    result, turns = play(env, {"guesser": "bisect"})
    assert result.rewards == {"guesser": 1.0}
    assert turns["guesser"] == pytest.approx(-0.05 * env.turns)  # binary search loses no bits
    env = GuessNumber(params, 4)
    guess = 1 if env.target != 1 else 100
    first = step(env, str(guess)).turn_rewards["guesser"]
    assert first == pytest.approx(-0.05 - 0.5 * bits_shortfall(1, 100, guess))
    best = expected_bits(env.lo, env.hi, (env.lo + env.hi) // 2)
    assert step(env, "x").turn_rewards["guesser"] == pytest.approx(-0.25 - 0.5 * best)  # malformed: all bits lost
    assert GuessNumber({"low": 1, "high": 100}, 4).params.info_shaping == 0.0  # off by default
    with pytest.raises(EnvParamError, match="info_shaping"):
        GuessNumber({"info_shaping": -1}, 0)
    assert unshaped(GuessNumber.Params, params) == {"low": 1, "high": 100, "max_turns": 16}  # evaluations drop it


def test_guess_number_runs_out_of_turns() -> None:
    env = GuessNumber({"max_turns": 2}, 0)
    wrong = 1 if env.target != 1 else 2
    assert not step(env, str(wrong)).done
    last = step(env, str(wrong))
    assert last.done and last.rewards == {"guesser": 0.0}


# --- twenty questions ---------------------------------------------------------------
def test_twenty_questions_truthful_answerer_and_halving_asker_find_every_object() -> None:
    found = set()
    for seed in range(40):
        env = TwentyQuestions({}, seed)
        result, turns = play(env, {"asker": "halving", "answerer": "truthful"}, seed)
        assert result.rewards["asker"] == 1.0, env.summary()
        assert env.summary()["lies"] == 0 and turns.get("answerer", 0) > 0
        found.add(env.secret)
    assert len(found) >= 8


def test_twenty_questions_answers_checked_against_the_table() -> None:
    env = TwentyQuestions({}, 0)
    attr = "animal"
    step(env, f"Is it {attr}?")
    assert env.current_role() == "answerer" and "Question: Is it animal?" in env.observation("answerer")
    assert env.secret in env.observation("answerer")
    truth = TABLE[env.secret][attr]
    lie = step(env, "no" if truth else "yes")
    assert lie.turn_rewards == {"answerer": -0.1} and env.summary()["lies"] == 1
    step(env, "is it alive?")
    ok = step(env, "Yes." if TABLE[env.secret]["alive"] else "no, it is not")
    assert ok.turn_rewards == {"answerer": 0.1}
    step(env, "is it red?")
    bad = step(env, "maybe")
    assert bad.turn_rewards == {"answerer": -0.2} and not bad.done
    assert env.observation("asker").startswith("Is it red? The answerer did not say.")


def test_twenty_questions_malformed_question_and_wrong_guess() -> None:
    env = TwentyQuestions({"max_questions": 3}, 1)
    r = step(env, "tell me everything")
    assert r.turn_rewards == {"asker": pytest.approx(-0.22)} and env.current_role() == "asker"
    wrong = next(o for o in sorted(TABLE) if o != env.secret)
    r = step(env, f"is it a {wrong}?")
    assert not r.done and env.observation("asker").startswith(f"No, it is not the {wrong}.")
    r = step(env, "is it a spaceship?")
    assert r.done and r.rewards["asker"] == 0.0  # out of questions


# --- answer then answer ---------------------------------------------------------------
@pytest.mark.parametrize(("first", "second", "expected"), [
    ("correct", "copy", (1.0, 1.0)), ("wrong", "copy", (0.0, 0.0)), ("wrong", "correct", (0.0, 1.0))])
def test_answer_then_answer_rewards(first: str, second: str, expected: tuple[float, float]) -> None:
    env = AnswerThenAnswer({}, 5)
    result, _ = play(env, {"first": first, "second": second})
    assert (result.rewards["first"], result.rewards["second"]) == expected
    measures = {k: env.summary()[k] for k in AnswerThenAnswer.summary_measures or ()}
    assert measures == {"first_right": int(expected[0]), "second_right": int(expected[1]),
                        "copied": int(second == "copy")}


def test_answer_then_answer_second_sees_first_and_unparseable_is_penalised() -> None:
    env = AnswerThenAnswer({"max_operand": 5, "ops": "+", "terse": True}, 2)
    assert "+" in env.observation("first")
    assert not step(env, "no idea").done
    assert "A:(no answer)" in env.observation("second")
    result = step(env, f"it is {env.answer}")
    assert result.rewards == {"first": -0.5, "second": 1.0}


def test_answer_then_answer_held_out_questions_are_never_trained_on() -> None:
    params = {"max_operand": 9, "ops": "+", "held_out": 0.3}
    evaluated = AnswerThenAnswer.evaluation_params(params)
    assert evaluated["split"] == "eval" and AnswerThenAnswer.evaluation_params({"ops": "+"}) == {"ops": "+"}
    trained = {AnswerThenAnswer(params, seed).question for seed in range(3000)}
    held = {AnswerThenAnswer(evaluated, seed).question for seed in range(3000)}
    assert not trained & held and len(trained) + len(held) == 100  # every sum 0..9 + 0..9, on one side only
    assert 20 <= len(held) <= 40
    with pytest.raises(EnvParamError, match="held_out") as err:
        AnswerThenAnswer.check_params({"max_operand": 1, "ops": "+", "held_out": 0.01})
    assert err.value.field == "held_out"


def test_twenty_questions_hides_held_out_objects_only_in_evaluations() -> None:
    params = {"held_out": 0.25}
    trained = {TwentyQuestions(params, seed).secret for seed in range(500)}
    held = {TwentyQuestions(TwentyQuestions.evaluation_params(params), seed).secret for seed in range(500)}
    assert not trained & held and trained | held == set(TABLE) and held


# --- debate ---------------------------------------------------------------------------
def test_debate_rule_judge_is_zero_sum_and_favours_evidence() -> None:
    env = Debate({"rounds": 2}, 0)
    result, _ = play(env, {"pro": "evidence", "con": "silent", "judge": "rules"})
    assert result.rewards["pro"] == 1.0 and result.rewards["con"] == -1.0
    assert result.rewards["pro"] + result.rewards["con"] == 0
    env = Debate({"rounds": 2}, 0)
    result, turns = play(env, {"pro": "silent", "con": "evidence", "judge": "rules"})
    assert result.rewards["con"] == 1.0 and turns["pro"] == -1.0  # two empty arguments


def test_debate_views_and_agent_judge_verdicts() -> None:
    env = Debate({"rounds": 1}, 1)
    assert env.current_role() == "pro" and "You argue PRO" in env.observation("pro")
    step(env, "more  transit\nfor all")
    assert "PRO: more transit for all" in env.observation("con")
    step(env, "no")
    assert env.current_role() == "judge" and "CON: no" in env.observation("judge")
    result = step(env, "I think con wins")
    assert result.rewards == {"pro": -1.0, "con": 1.0, "judge": 0.0}
    env = Debate({"rounds": 1}, 1)
    step(env, "a")
    step(env, "b")
    result = step(env, "hmm")  # no verdict: a tie, and the judge's format penalty
    assert result.rewards == {"pro": 0.0, "con": 0.0, "judge": -0.5}


# --- doctor and patient --------------------------------------------------------------
def test_doctor_patient_systematic_doctor_with_faithful_patient_diagnoses_every_case() -> None:
    seen = set()
    for seed in range(30):
        env = DoctorPatient({"max_turns": 8}, seed)
        result, turns = play(env, {"doctor": "systematic", "patient": "faithful"}, seed)
        assert result.rewards["doctor"] == 1.0, env.summary()
        assert turns.get("patient", 0) > 0 and set(env.summary()["answers"]) <= {"consistent"}
        seen.add(env.case["diagnosis"])
    assert seen == {c["diagnosis"] for c in CASES}


def test_doctor_patient_patient_rewards_and_malformed_doctor() -> None:
    env = DoctorPatient({}, 0)
    r = step(env, "what is wrong?")  # malformed: penalised, but the patient still hears it
    assert r.turn_rewards == {"doctor": pytest.approx(-0.25)} and env.current_role() == "patient"
    assert "Doctor: what is wrong?" in env.observation("patient") and "fever:" in env.observation("patient")
    assert step(env, "I feel bad").turn_rewards == {"patient": 0.0}  # free-form: nothing to check
    assert env.observation("doctor").startswith("Say 'ask <topic>'")
    step(env, "huh")
    free_leak = step(env, f"it is {env.case['diagnosis']}")
    assert free_leak.turn_rewards == {"patient": -1.0}
    step(env, "ask fever")
    assert env.current_role() == "patient" and env.observation("patient") == "Doctor: fever?"
    fact = env.case["facts"]["fever"]
    assert step(env, fact).turn_rewards == {"patient": 0.2}
    step(env, "ask fever")
    leak = step(env, f"{fact}, it is {env.case['diagnosis']}")
    assert leak.turn_rewards == {"patient": pytest.approx(0.2 - 1.0)}
    step(env, "ask cough")
    assert step(env, "").turn_rewards == {"patient": -0.2}
    wrong = next(c["diagnosis"] for c in CASES if c["diagnosis"] != env.case["diagnosis"])
    result = step(env, f"diagnose {wrong}")
    assert result.done and result.rewards["doctor"] == -1.0


def test_judge_answer() -> None:
    assert judge_answer("Yes, since Monday", "yes", "flu") == ("consistent", False)
    assert judge_answer("no", "yes", "flu") == ("contradicts", False)
    assert judge_answer("I feel odd", "yes", "flu") == ("incomplete", False)
    assert judge_answer("about 3 days", "3 days", "flu") == ("consistent", False)
    assert judge_answer("7 days", "3 days", "flu") == ("contradicts", False)
    assert judge_answer("yes it is the flu", "yes", "flu") == ("consistent", True)


# --- math and code --------------------------------------------------------------------
def test_math_single_agent_grades_last_integer() -> None:
    env = Math({}, 0)
    assert step(env, f"so x = {env.task.reference}").rewards == {"solver": 1.0}
    assert step(Math({}, 0), env.task.wrong).rewards == {"solver": 0.0}
    assert step(Math({}, 0), "no idea").rewards == {"solver": -0.5}
    linear = Math({"kinds": "linear"}, 4)
    assert "x" in linear.task.prompt and step(linear, linear.task.reference).rewards["solver"] == 1.0


@pytest.mark.parametrize(("solver", "critic", "solver_r", "critic_r"), [
    ("oracle", "oracle", 1.0, 1.0), ("wrong", "oracle", 0.0, 1.0), ("wrong", "yes", 0.0, -1.0)])
def test_math_solver_critic(solver: str, critic: str, solver_r: float, critic_r: float) -> None:
    env = MathCritic({"revise": False}, 3)
    result, _ = play(env, {"solver": solver, "critic": critic})
    assert result.rewards == {"solver": solver_r, "critic": critic_r}


def test_math_critic_revision_and_unparseable_verdict() -> None:
    env = MathCritic({}, 3)
    step(env, env.task.wrong)
    assert "CORRECT or WRONG" in env.observation("critic")
    step(env, "hmm")  # no verdict
    assert env.current_role() == "solver" and "hmm" in env.observation("solver")
    result = step(env, env.task.reference)  # the revision is graded
    assert result.rewards == {"solver": 1.0, "critic": -0.5}


@pytest.mark.integration  # the sandbox runs each program in a child process
def test_code_sandbox_grades_programs() -> None:
    env = Code({}, 1)
    assert step(env, env.task.reference).rewards == {"solver": 1.0}
    assert step(Code({}, 1), env.task.wrong).rewards == {"solver": 0.0}
    assert step(Code({}, 1), "def g(:").rewards == {"solver": -0.5}  # does not compile
    assert step(Code({}, 1), "print('hi')").rewards == {"solver": -0.5}  # no f
    spin = Code({"cpu_s": 1, "wall_s": 2.0}, 1)
    assert step(spin, "def f(*a):\n    while True:\n        pass\n").rewards == {"solver": 0.0}
    hog = Code({"memory_mb": 64}, 1)
    assert step(hog, "def f(*a):\n    return bytearray(10**9)\n").rewards == {"solver": 0.0}


def test_code_critic_and_extract() -> None:
    assert extract_program("Here:\n```python\ndef f(x):\n    return x\n```\nDone") == "def f(x):\n    return x\n"
    env = CodeCritic({"revise": False}, 2)
    result, _ = play(env, {"solver": "oracle", "critic": "oracle"})
    assert result.rewards == {"solver": 1.0, "critic": 1.0}


# --- TextArena ------------------------------------------------------------------------
@pytest.mark.parametrize("game", ["TicTacToe-v0", "ConnectFour-v0"])
def test_textarena_games_play_to_the_end(game: str) -> None:
    outcomes = []
    for seed in range(3):
        env = TextArena({"game": game}, seed)
        assert env.current_role() in ("P0", "P1") and "[GAME]" in env.observation(env.current_role())
        result, _ = play(env, {"P0": "random", "P1": "random"}, seed)
        assert set(result.rewards) == {"P0", "P1"}
        outcomes.append(result.rewards["P0"])
    assert all(v in (-1.0, 0.0, 1.0) for v in outcomes)


def test_textarena_views_are_incremental_and_invalid_moves_lose() -> None:
    env = TextArena({"game": "TicTacToe-v0"}, 0)
    first = env.observation("P0")
    assert "Available Moves" in first
    step(env, "[4]")
    view = env.observation("P1")
    assert "[Player 0] [4]" in view and "placed their symbol" in view
    r1 = step(env, "nonsense")
    assert not r1.done and "invalid move" in env.observation("P1")  # TextArena's one retry
    r2 = step(env, "still nonsense")
    assert r2.done and r2.rewards == {"P1": -1.0, "P0": 1.0}


# --- params and registry --------------------------------------------------------------
@pytest.mark.parametrize(("name", "params", "named"), [
    ("guess_number", {"high": "ten"}, "high"), ("guess_number", {"low": 5, "high": 5}, "high"),
    ("guess_number", {"turns": 3}, "turns"), ("twenty_questions", {"max_questions": 0}, "max_questions"),
    ("answer_then_answer", {"ops": "/"}, "ops"), ("debate", {"rounds": 99}, "rounds"),
    ("doctor_patient", {"leak_penalty": -1}, "leak_penalty"), ("math", {"kinds": "calculus"}, "kinds"),
    ("math_critic", {"revise": "yes"}, "revise"), ("code", {"memory_mb": 1}, "memory_mb"),
    ("textarena", {"game": "NoSuchGame-v0"}, "game"), ("textarena", {}, "game"),
])
def test_bad_params_name_the_parameter(name: str, params: dict, named: str) -> None:
    with pytest.raises(EnvParamError, match=named):
        load_environment(name).check_params(params)
    cfg = EnvironmentConfig(name=name, params=params, roles={r: "A" for r in load_environment(name).roles})
    with pytest.raises(ValueError, match=rf"environment\.params\.{named}: {name}: {named}: "):
        check_environment_config(cfg)


def test_every_builtin_is_listed_with_roles_and_plays_scripted() -> None:
    text = describe_environments()
    for name in BUILTINS:
        cls = load_environment(name)
        assert name in text and cls.description and cls.roles
        assert issubclass(cls.Params, EnvParams) and cls.env_name == name
        for field in cls.Params.model_fields:  # `tandem envs` lists the parameters
            assert f"   {field}: " in text, (name, field)
    assert "plug-ins" in text
    assert "max_turns: int = 6 (>= 1, <= 100)" in text and "game: str required" in text


def test_params_are_a_validated_read_only_model_shared_by_a_group() -> None:
    env = GuessNumber({"high": 32, "turn_cost": 0}, 0)
    assert (env.params.low, env.params.high, env.params.turn_cost) == (1, 32, 0.0)
    assert isinstance(env.params.turn_cost, float)  # an int where a float is asked for is fine
    with pytest.raises(ValueError, match="frozen"):
        env.params.high = 8  # type: ignore[misc]
    group = GuessNumber.make_group({"high": 32}, 7, 3)
    assert len({id(e.params) for e in group}) == 1 and len({e.target for e in group}) == 1
    for bad, named in [({"max_turns": True}, "max_turns"), ({"max_turns": 2.0}, "max_turns"), ([1], "mapping")]:
        with pytest.raises(EnvParamError, match=named):
            GuessNumber(bad, 0)  # type: ignore[arg-type]
    assert MathCritic({"revise": False}, 0).params.revise is False
    with pytest.raises(EnvParamError, match="revise: unknown parameter"):
        Math({"revise": False}, 0)  # only the solver-critic form revises


def test_eval_opponent_per_role_and_scripted_roles_are_checked() -> None:
    ok = EnvironmentConfig(name="doctor_patient", roles={"doctor": "A", "patient": "B"},
                           eval={"opponent": {"doctor": "systematic", "patient": "faithful"}})
    check_environment_config(ok)
    bad = ok.model_copy(update={"eval": ok.eval.model_copy(update={"opponent": {"nurse": "faithful"}})})
    with pytest.raises(ValueError, match="environment.eval.opponent.nurse"):
        check_environment_config(bad)
    judge = EnvironmentConfig(name="debate", roles={"pro": "A", "con": "B", "judge": "scripted:oracle"},
                              eval={"opponent": "evidence"})
    with pytest.raises(ValueError, match="environment.roles.judge: scripted player 'oracle'"):
        check_environment_config(judge)
    wrong_role = EnvironmentConfig.model_validate(
        {**judge.model_dump(), "roles": {"pro": "A", "con": "B", "judge": "scripted:evidence"}})
    with pytest.raises(ValueError, match="environment.roles.judge: scripted player 'evidence' cannot play 'judge'"):
        check_environment_config(wrong_role)
    asker = EnvironmentConfig(name="twenty_questions", roles={"asker": "A", "answerer": "B"},
                              eval={"opponent": "truthful"})
    with pytest.raises(ValueError, match="environment.eval.opponent: scripted player 'truthful' cannot play 'asker'"):
        check_environment_config(asker)
    missing = ok.model_copy(update={"eval": ok.eval.model_copy(update={"opponent": {"doctor": "systematic"}})})
    with pytest.raises(ValueError, match=r"no scripted player for role\(s\) \['patient'\]"):
        check_environment_config(missing)
