"""The guess-the-number language demo (services/demo/language.py, docs/architecture.md §8): the weak
guesser's soft targets, the token-exact synthetic dialogues, the warm-start at tiny sizes and, slow,
the warm-started model playing legal games through the real episode path."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from pathlib import Path

import pytest

from services.demo.language import (
    EOS,
    GUESS_PARAMS,
    collate_soft,
    dialogue_example,
    eval_guesser,
    guess_distribution,
    next_char_distribution,
    reply_targets,
    warmstart_guess,
)
from services.demo.tiny_model import build_tokenizer
from services.envs.guess_number import GuessNumber
from services.inference.generator import Engine
from services.launcher.cli import build_parser
from services.play.local import EnginePlayers


def test_guess_distribution_stays_in_the_range_left() -> None:
    dist = guess_distribution(51, 60)
    assert set(dist) == set(range(51, 61)) and math.isclose(sum(dist.values()), 1.0)
    uniform = guess_distribution(51, 60, (1, 0, 0))
    assert all(math.isclose(p, 0.1) for p in uniform.values())
    mid = guess_distribution(1, 100, (0, 1, 0))
    assert max(mid, key=mid.get) in (50, 51) and mid[50] > 10 * mid[10]
    ends = guess_distribution(1, 100, (0, 0, 1))
    assert math.isclose(ends[1], ends[100]) and ends[1] > 10 * ends[50]
    assert guess_distribution(7, 7) == {7: 1.0}
    with pytest.raises(ValueError, match="empty range"):
        guess_distribution(8, 7)


def test_next_char_distribution_is_the_exact_conditional() -> None:
    uniform = guess_distribution(1, 100, (1, 0, 0))
    first = next_char_distribution(uniform, "")
    assert math.isclose(first["1"], 12 / 100)  # 1, 10-19, 100
    assert math.isclose(first["9"], 11 / 100)
    assert EOS not in first
    after_one = next_char_distribution(uniform, "1")
    assert math.isclose(after_one[EOS], 1 / 12) and math.isclose(after_one["0"], 2 / 12)
    assert next_char_distribution(uniform, "100") == {EOS: 1.0}
    narrow = next_char_distribution(guess_distribution(51, 60, (1, 0, 0)), "")
    assert narrow == pytest.approx({"5": 0.9, "6": 0.1})


def test_reply_targets_spell_the_guess_and_end_with_eos() -> None:
    tok = build_tokenizer()
    dist = guess_distribution(40, 49, (1, 0, 0))
    reply, targets = reply_targets(tok, dist, 42, start=10)
    assert tok.decode(reply, skip_special_tokens=True) == "42" and reply[-1] == tok.eos_token_id
    assert [pos for pos, _ in targets] == [10, 11, 12]
    assert targets[0][1] == [(tok.encode("4", add_special_tokens=False)[0], 1.0)]
    assert len(targets[1][1]) == 10 and targets[2][1] == [(tok.eos_token_id, 1.0)]


def test_dialogue_is_the_guessers_token_exact_view() -> None:
    tok = build_tokenizer()
    ex, weights = dialogue_example(tok, random.Random(3), seed=5)
    text = tok.decode(ex.tokens)
    assert text.startswith("<|user|>Guess my number, 1-100.<|end|><|assistant|>")
    assert text.endswith("<|end|>") and "; " in text  # show_range feedback
    target = GuessNumber(GUESS_PARAMS, 5).target
    assert text.endswith(f"<|assistant|>{target}<|end|>") or text.count("<|assistant|>") == GUESS_PARAMS["max_turns"]
    assert len(ex.targets) == len(weights)
    for (pos, ids), probs in zip(ex.targets, weights, strict=True):
        assert ex.tokens[pos] in ids and math.isclose(sum(probs), 1.0, rel_tol=1e-6)
    _, _, dist = collate_soft([(ex, weights)], tok.pad_token_id, 264)
    rows = dist.sum(-1)
    assert int((rows > 0).sum()) == len(ex.targets) and float(rows.max()) == pytest.approx(1.0)


def test_show_range_feedback_and_instructions() -> None:
    env = GuessNumber({**GUESS_PARAMS, "system": {"guesser": "Reply with one integer."}}, 11)
    assert env.system_prompt("guesser") == "Reply with one integer."
    assert GuessNumber(GUESS_PARAMS, 11).system_prompt("guesser") is None
    low = env.target - 1 if env.target > 1 else None
    if low is not None:
        asyncio.run(env.step("guesser", str(low)))
        assert env.observation("guesser") == f"{low} is too low; {env.target:03d}-100."
    unpadded = GuessNumber({**GUESS_PARAMS, "pad_range": False}, 11)
    if low is not None:
        asyncio.run(unpadded.step("guesser", str(low)))
        assert unpadded.observation("guesser") == f"{low} is too low; {env.target}-100."
    plain = GuessNumber({"low": 1, "high": 100}, 11)
    asyncio.run(plain.step("guesser", "100" if plain.target < 100 else "1"))
    assert ";" not in plain.observation("guesser")


def test_dialogue_guesses_respect_the_range_the_feedback_states() -> None:
    """Every synthetic guess lies in the range the previous feedback states (padded, "051-100"), every
    soft target puts all its mass on numbers in it, and the guesser nearly always finds the number."""
    tok = build_tokenizer()
    found, turns = 0, 0
    for seed in range(30):
        ex, weights = dialogue_example(tok, random.Random(seed), seed=seed)
        text = tok.decode(ex.tokens)
        pairs = re.findall(r"<\|user\|>([^<]*)<\|end\|><\|assistant\|>(\d+)<\|end\|>", text)
        assert pairs and pairs[0][0] == "Guess my number, 1-100."
        lo, hi = 1, 100
        for feedback, guess in pairs:
            stated = re.search(r"; (\d{3})-(\d{3})\.$", feedback)
            if stated:
                lo, hi = int(stated.group(1)), int(stated.group(2))
            assert lo <= int(guess) <= hi, (seed, feedback, guess)
            dist = guess_distribution(lo, hi)
            assert min(dist) >= lo and max(dist) <= hi
        target = GuessNumber(GUESS_PARAMS, seed).target
        found += int(pairs[-1][1]) == target
        turns += len(pairs)
    assert found >= 27 and 5 <= turns / 30 <= 14


def test_init_demo_takes_the_guess_task() -> None:
    args = build_parser().parse_args(["init-demo", "--task", "guess"])
    assert args.task == "guess" and args.out_dir is None


def test_tiny_warmstart_writes_a_model(tmp_path: Path) -> None:
    out = warmstart_guess(tmp_path / "m", games=4, epochs=1, hidden=32, layers=1, eval_games=0, verbose=False)
    stats = json.loads((out / "warmstart.json").read_text())
    assert (out / "model.safetensors").exists() and stats["train_games"] == 4
    assert math.isfinite(stats["final_loss"])


@pytest.mark.slow
def test_warm_guess_model_plays_legal_games(tmp_path: Path) -> None:
    """A smaller warm start than the default (a minute or two on a quiet 2-core machine), then seeded
    held-out games through ``play_episode``: every game runs to its end, nearly every reply is an
    integer in 1-100, and some games find the number."""
    out = warmstart_guess(tmp_path / "m", games=600, epochs=3, hidden=64, eval_games=0, verbose=False)
    players = EnginePlayers({"g": Engine(out)})
    try:
        stats = asyncio.run(eval_guesser(players, "g", 40, 1.0))
    finally:
        players.stop()
    assert stats["games"] == 40
    assert stats["format_rate"] <= 0.1, stats
    assert stats["fail_rate"] < 1.0, stats
    assert 1 <= stats["mean_guesses"] <= stats["mean_turns"] <= GUESS_PARAMS["max_turns"]
