"""Engine replies checked by the coordinator before they enter an episode (issue 12; docs/architecture.md §2.3).

The coordinator (real, on the real Redis) plays a group of four tic-tac-toe episodes with agent A against the
env's scripted player, through its own reply consumer (``bus.consume`` → ``TurnRouter.on_reply``, as its
``__main__`` runs it). A's "engine" is this test: it answers every turn request with the tiny model's real
generation (the in-process engine), but tampers with the first reply of one episode (a token id outside the
vocabulary: well formed, so the wire contract lets it through) and sends a stray reply from an agent the run
does not have. The tampered reply is dead-lettered by the coordinator with its reason, its episode is abandoned and
counted (``/v1/status``), and the group's other three episodes complete.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from services.common.bus import Bus
from services.contracts.codec import FIELD, decode
from services.contracts.config import parse_config
from services.contracts.messages import DeadLetter, GenerateReply, GenerateRequest
from services.contracts.players import AgentPlayer, Local, Scripted
from services.coordinator.api import create_app
from services.coordinator.scheduler import Coordinator
from services.play.local import LocalPlayers
from tests.helpers import play_group_over_bus


async def test_a_bad_reply_is_rejected_alone_and_its_episode_abandoned(redis_url: str, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    cfg = parse_config({"run": {"name": "replies", "output_dir": str(tmp_path / "runs")}, "redis_url": redis_url,
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}, "group_size": 4},
                        "agents": {a: {"model_path": str(tiny_model_dir), "sampling": {"max_new_tokens": 4}}
                                   for a in "AB"}})
    bus = Bus(redis_url, "replies", "coordinator")
    coord = Coordinator(cfg, bus)
    engine_bus = Bus(redis_url, "replies", "rollout-A")
    local, model = LocalPlayers(), Local(path=str(tiny_model_dir), agent="A")
    tampered, forged = {}, []
    vocab = coord.router.replies.vocab["A"]
    assert vocab is not None

    async def engine(req: GenerateRequest) -> None:
        reply = (await local.generate(model, req)).model_copy(update={"weight_version": 0})
        if not tampered:
            tampered[req.episode_id] = reply.model_copy(update={"output_ids": [vocab, *reply.output_ids[1:]]})
            reply = tampered[req.episode_id]
        elif not forged:
            forged.append(reply.model_copy(update={"agent": "C", "id": "forged-agent", "request_id": "none"}))
            await engine_bus.publish(req.reply_stream, forged[0])
        await engine_bus.publish(req.reply_stream, reply)

    try:
        roles = {"X": AgentPlayer(agent="A"), "O": Scripted(name="random")}
        done = await play_group_over_bus(coord, engine_bus, engine, roles, 0, concurrency=4)
    finally:
        local.close()
    assert len(tampered) == 1 and forged
    bad_episode = next(iter(tampered))
    assert len(done) == 3 and bad_episode not in {r.episode_id for r in done}  # the rest went on
    letters = [decode(f[FIELD], DeadLetter) for _, f in await bus.redis.xrange(bus.streams.deadletter)]
    assert len(letters) == 2, [x.reason for x in letters]
    by_id = {decode(x.payload, GenerateReply).id: x for x in letters}
    bad = by_id[tampered[bad_episode].id]
    assert bad.source_stream == bus.streams.replies(coord.name) and bad.service == "coordinator"
    assert bad.reason.startswith("rejected by coordinator: output_ids[0] =") and "vocabulary" in bad.reason
    assert "not an agent of this run" in by_id["forged-agent"].reason
    transport = httpx.ASGITransport(app=create_app(coord))
    async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
        status = (await client.get("/v1/status")).json()
    assert status["rejected_replies"] == {"A": {"replies": 1, "episodes_abandoned": 1},
                                          "?": {"replies": 1, "episodes_abandoned": 0}}
    await engine_bus.close()
    await bus.close()


async def test_the_check_covers_what_the_wire_contract_does_not(redis_url: str, tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    cfg = parse_config({"run": {"name": "replies2", "output_dir": str(tmp_path / "runs")}, "redis_url": redis_url,
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
                        "agents": {a: {"model_path": str(tiny_model_dir)} for a in "AB"}})
    coord = Coordinator(cfg, Bus(redis_url, "replies2", "coordinator"))
    check, vocab = coord.router.replies, coord.router.replies.vocab["A"]
    good = GenerateReply(request_id="r", agent="A", episode_id="e", turn=0, output_ids=[0, vocab - 1],
                         output_logprobs=[-0.5, 0.0], finish_reason="stop", weight_version=0, engine="x")
    assert check.problem(good) is None
    unchecked = {"output_ids": [1, 2], "output_logprobs": [float("nan"), -1.0]}  # as a buggy in-process writer
    assert "is not a log-probability" in check.problem(GenerateReply.model_construct(**{**dict(good), **unchecked}))
    positive = GenerateReply.model_construct(**{**dict(good), "output_logprobs": [-0.1, 0.5]})
    assert "output_logprobs[1] = 0.5" in check.problem(positive)
    assert "2 output ids but 1 logprobs" in check.problem(GenerateReply.model_construct(
        **{**dict(good), "output_logprobs": [-0.1]}))
    await coord.bus.close()
