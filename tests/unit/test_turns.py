"""Turns as records: each generation of a view is a ``Turn`` (span, weight version, reply, what it earned), the
samples' ``turns``, ``turn_rewards`` and per-turn lists come from those records, one rule (``trains``) decides
which views become samples, and a Sample's ``turns`` are checked where it enters (spans inside the tokens, on
the mask's 1s and on all of them, one value per turn)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgpack
import pytest
from pydantic import ValidationError

from services.common.bus import Bus
from services.contracts.codec import FIELD, decode
from services.contracts.messages import DeadLetter, GenerateReply, GenerateRequest, Sample, SamplingParams
from services.contracts.players import AgentPlayer, Local, Player
from services.coordinator.dashboard.transcripts import reply_tokens
from services.envs.registry import load_environment
from services.play.episode import EpisodeResult, View, group_samples, play_episode, trains, turn_credit
from services.training.credit import token_advantages
from services.training.value import state_positions
from tests.unit.test_render import CHATML, byte_tokenizer

TOK = byte_tokenizer(["<|im_start|>", "<|im_end|>"], "<|im_end|>", CHATML)
A = AgentPlayer(agent="A")


def reply(ids: list[int], version: int = 3, rid: str = "r") -> GenerateReply:
    return GenerateReply(request_id=rid, agent="A", episode_id="e", turn=0, output_ids=ids,
                         output_logprobs=[-0.5] * len(ids), finish_reason="stop", weight_version=version, engine="A-0")


def play(replies: list[str | None]) -> EpisodeResult:
    """tool_math played by ``A`` answering ``replies`` in order (None: a generation of no token)."""
    texts, versions = list(replies), iter(range(1, 100))

    async def generate(player: Player, request: GenerateRequest) -> GenerateReply:
        text = texts.pop(0)
        ids = [] if text is None else TOK.encode(text, add_special_tokens=False) + [TOK.eos_token_id]
        return reply(ids, next(versions), f"r{len(texts)}")

    env = load_environment("tool_math")({"system": {"solver": "Solve."}}, 1)
    return asyncio.run(play_episode(env, "ep", "g", {"solver": A}, {A: TOK}, {A: SamplingParams(max_new_tokens=64)},
                                    generate, rng=random.Random(0)))


def test_a_tool_call_turn_is_one_record_per_generation() -> None:
    env = load_environment("tool_math")({}, 1)
    result = play(["CALL calculator 6*7", "CALL calculator 1+1", env.task.reference])
    view = result.views["solver"]
    assert [t.turn for t in view.turns] == [0, 0, 0] and [t.weight_version for t in view.turns] == [1, 2, 3]
    assert len({t.reply_id for t in view.turns}) == 3
    for t in view.turns:  # each record is exactly one generation's tokens, all mask 1, context around them
        assert t.end > t.start and all(view.loss_mask[t.start:t.end]) and view.loss_mask[t.start - 1] == 0
    assert sum(t.end - t.start for t in view.turns) == sum(view.loss_mask)
    (sample,) = result.samples({"A": 1})
    assert [(s.start, s.end) for s in sample.turns] == [(t.start, t.end) for t in view.turns] == sample.spans
    assert sample.weight_versions == [1, 2, 3] and sample.reply_ids == [t.reply_id for t in view.turns]
    assert sample.turn_rewards == [0.0, 0.0, 1.0] and result.rewards == {"solver": 1.0}
    (turn,) = reply_tokens(result.views)["solver"]["turns"]  # the dashboard's reply: the turn's three generations
    assert turn["turn"] == 0 and turn["weight_version"] == 3
    assert turn["ids"] == [t for t, m in zip(view.tokens, view.loss_mask, strict=True) if m]


def test_a_generation_of_no_token_is_no_turn_and_keeps_the_turn_rewards() -> None:
    """A tool turn whose last generation is empty: recorded (its version and reply), not a turn of the sample;
    the sample still carries its turn rewards (the transcript's count, two generations, would not match)."""
    result = play(["CALL calculator 6*7", None])
    view = result.views["solver"]
    assert [t.end - t.start for t in view.turns][1] == 0 and view.weight_versions == [1, 2]
    assert result.transcript[0]["generations"] == 2 and len(view.generated) == 1
    (sample,) = result.samples({"A": 1})
    reward = result.rewards["solver"]
    assert sample.turn_rewards == [reward] and sample.weight_versions == [1] and len(sample.turns) == 1


def test_rewards_before_the_first_turn_and_after_an_empty_one() -> None:
    view = View(player=A, role="guesser")
    view.earn(0.25)                        # before any generation
    view.add_context([1, 2])
    view.add_reply(reply([]), 0)           # nothing generated: still before the first turn
    view.earn(0.5)
    assert view.reward_before == 0.75 and not view.generated and turn_credit(view, 1.0) == []
    view.add_context([3])
    view.add_reply(reply([7, 8]), 1)
    view.earn(-0.1)
    view.add_context([4])
    view.add_reply(reply([]), 2)           # its rewards go to the turn before
    view.earn(-0.2)
    view.add_context([5])
    view.add_reply(reply([9]), 3)
    assert [t.reward for t in view.generated] == pytest.approx([-0.3, 0.0])
    assert turn_credit(view, 2.0) == pytest.approx([0.75 - 0.3, 2.0 - 0.45])


def test_one_rule_decides_which_views_become_samples() -> None:
    """An agent's view that generated, one whose only generation was empty, another agent's, and an in-process
    copy of A: the group's counts and the samples agree, view by view."""
    def view(player: Player, role: str, ids: list[int]) -> View:
        v = View(player=player, role=role)
        v.add_context([1])
        v.add_reply(reply(ids))
        return v

    views = {"X": view(A, "X", [5]), "O": view(A, "O", []), "P": view(AgentPlayer(agent="B"), "P", [6]),
             "Q": view(Local(path="/w", agent="A"), "Q", [7])}
    result = EpisodeResult("e", "g", {r: v.player for r, v in views.items()}, dict.fromkeys(views, 1.0), [], views,
                           {}, "train")
    assert [r for r, v in views.items() if trains(v, {"A", "B"})] == ["X", "P"]
    counts = group_samples([result, result], {"A", "B", "C"})
    assert counts == {"A": 2, "B": 2, "C": 0}
    samples = result.samples(counts)
    assert sorted((s.role, s.agent, s.group_samples) for s in samples) == [("P", "B", 2), ("X", "A", 2)]
    assert group_samples([result], {"B"}) == {"B": 1} and [s.role for s in result.samples({"B": 1})] == ["P"]


GOOD: dict[str, Any] = {"agent": "A", "role": "X", "episode_id": "e", "group_id": "g", "group_samples": 2,
                        "tokens": [5, 6, 40, 41, 42, 7], "loss_mask": [0, 1, 1, 1, 1, 0],
                        "rollout_logprobs": [0.0, -1.0, -0.5, -0.5, -0.5, 0.0], "reward": 1.0,
                        "turns": [{"start": 1, "end": 3}, {"start": 3, "end": 5}], "weight_versions": [0, 1],
                        "turn_rewards": [0.25, 0.75]}


def test_turns_name_spans_the_mask_alone_cannot() -> None:
    """Two generations that touch are one run of 1s: the turns keep them apart for the trainer's credit."""
    s = Sample(**GOOD)
    assert s.spans == [(1, 3), (3, 5)] and state_positions(s) == [0, 2]
    assert token_advantages([s], [[1.0, 2.0]])[0].tolist() == [1, 1, 2, 2, 0]
    old = {k: v for k, v in GOOD.items() if k not in ("turns", "turn_rewards")} | {"weight_versions": [0]}
    again = decode(msgpack.packb(old, use_bin_type=True), Sample)  # a producer without turns: still read
    assert again.turns == [] and again.spans == [(1, 5)] and state_positions(again) == [0]


@pytest.mark.parametrize(("change", "reason"), [
    ({"turns": [{"start": 1, "end": 3}, {"start": 3, "end": 9}]}, r"turns\[1\] = \[3, 9\) is not a non-empty span"),
    ({"turns": [{"start": 3, "end": 5}, {"start": 1, "end": 3}]}, r"turns\[1\] = \[1, 3\) is not a non-empty span"),
    ({"turns": [{"start": 0, "end": 3}, {"start": 3, "end": 5}]}, r"\[0, 3\) covers tokens of loss mask 0"),
    ({"turns": [{"start": 1, "end": 3}, {"start": 4, "end": 5}]}, "a generated token outside every turn"),
    ({"turns": [{"start": 2, "end": 2}, {"start": 3, "end": 5}]}, r"turns\[0\] = \[2, 2\) is not a non-empty span"),
    ({"turn_rewards": [1.0]}, "turn_rewards has 1 values for 2 generated turns"),
    ({"weight_versions": [0]}, "weight_versions has 1 values for 2 turns"),
    ({"reply_ids": ["r1", "r2", "r3"]}, "reply_ids has 3 values for 2 turns"),
    ({"turns": [{"start": -1, "end": 3}]}, "turns.0.start"),
])
def test_inconsistent_turns_are_rejected_naming_why(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValidationError, match=reason):
        decode(msgpack.packb({**GOOD, **change}, use_bin_type=True), Sample)


async def test_the_buffer_dead_letters_a_sample_whose_turns_do_not_fit(redis_url: str) -> None:
    """An untrusted sample on the real stream, read by the real consumer loop: dead-lettered with the reason."""
    bus = Bus(redis_url, "turns", "buffer-A")
    stream = bus.streams.samples("A")
    raw = msgpack.packb({**GOOD, "turns": [{"start": 1, "end": 3}]}, use_bin_type=True)
    await bus.redis.xadd(stream, {FIELD: raw})
    seen: list[Sample] = []

    async def on_sample(sample: Sample) -> None:
        seen.append(sample)

    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(stream, "buffer", "buffer-A", on_sample, stop, block_ms=50))
    for _ in range(400):
        if await bus.redis.xlen(bus.streams.deadletter):
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task
    ((_, fields),) = await bus.redis.xrange(bus.streams.deadletter)
    letter = decode(fields[FIELD], DeadLetter)
    assert letter.payload == raw and not seen
    assert "invalid Sample" in letter.reason and "turns cover 2 tokens, loss_mask has 4 1s" in letter.reason
    await bus.close()
