"""services/play and the one sampler: typed players through the episode loop, evaluation, in-process engines.

The sampler (services/inference/sampling.py) is checked on hand-made logits; the embedded engine's
HTTP server and an in-process player, given the same seed, must return the same tokens and logprobs.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest
import torch

from services.contracts.config import EnvironmentConfig
from services.contracts.messages import GenerateRequest, SamplingParams
from services.contracts.players import AgentPlayer, Local, Pool, Scripted
from services.contracts.sglang_api import GenerateReqOutput
from services.engine.server import create_app
from services.envs.tictactoe import TicTacToe
from services.inference.generator import Engine
from services.inference.sampling import sample
from services.play.episode import play_episode
from services.play.evaluation import evaluate_player, play_eval
from services.play.local import EnginePlayers, LocalPlayers

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def draws(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {sample(LOGITS, [temperature], [top_p], [top_k], [gen])[0][0] for _ in range(n)}


def test_temperature_zero_is_argmax_with_the_logprob_of_temperature_one() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(3))
    for t in (0.0, 1e-7):
        toks, lps = sample(logits, [t] * 5, [1.0] * 5, [-1] * 5, [None] * 5)
        assert toks == logits.argmax(-1).tolist()
        assert lps == pytest.approx(torch.log_softmax(logits, -1).max(-1).values.tolist(), abs=1e-6)


def test_top_k_and_top_p_restrict_the_draw_but_not_the_logprob() -> None:
    assert draws(300) == {0, 1, 2, 3}
    assert draws(300, top_k=1) == {0}
    assert draws(300, top_k=2) == {0, 1}
    assert draws(300, top_p=0.6) == {0, 1}  # 0.5 before token 1 is < 0.6, 0.8 before token 2 is not
    assert draws(300, top_p=0.45) == {0}
    gen = torch.Generator().manual_seed(1)
    toks, lps = sample(LOGITS, [1.0], [0.6], [-1], [gen])
    assert lps[0] == pytest.approx(float(torch.log_softmax(LOGITS, -1)[0, toks[0]]))  # not renormalised
    toks, lps = sample(LOGITS, [0.5], [1.0], [1], [gen])
    assert lps[0] == pytest.approx(float(torch.log_softmax(LOGITS / 0.5, -1)[0, 0]))  # log_softmax(logits / T)


def test_a_seeded_row_draws_the_same_whatever_else_is_in_the_batch() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    alone = [sample(logits[i:i + 1], [0.9], [0.95], [20], [torch.Generator().manual_seed(i)])[0][0] for i in range(4)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    together, _ = sample(logits, [0.9, 0.0, 0.9, 0.9], [0.95] * 4, [20] * 4, gens)
    assert together[0] == alone[0] and together[2:] == alone[2:]
    assert together[1] == int(logits[1].argmax())


async def test_the_engine_server_and_an_in_process_player_give_the_same_tokens(tiny_model_dir: Path) -> None:
    app = create_app(tiny_model_dir, weight_version=0, max_batch=8, engine_id="e")
    local = LocalPlayers()
    player = Local(path=str(tiny_model_dir), agent="A")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
            for seed, temperature, top_p, top_k in [(1, 1.0, 1.0, -1), (2, 0.7, 0.9, 30), (3, 0.0, 1.0, -1)]:
                body = {"input_ids": [5, 6, 7, 8], "return_logprob": True, "sampling_params": {
                    "temperature": temperature, "top_p": top_p, "top_k": top_k, "max_new_tokens": 6,
                    "sampling_seed": seed, "ignore_eos": False}}
                resp = await client.post("/generate", json=body)
                served = GenerateReqOutput.model_validate(resp.json())
                req = GenerateRequest(agent=str(player), episode_id="e", group_id="g", turn=0, role="X",
                                      input_ids=[5, 6, 7, 8], reply_stream="", sampling=SamplingParams(
                                          temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=6,
                                          seed=seed))
                reply = await local.generate(player, req)
                assert reply.output_ids == served.output_ids
                lps = [lp for lp, _, _ in served.meta_info.output_token_logprobs or []]
                assert reply.output_logprobs == pytest.approx(lps, abs=1e-5)
                assert reply.weight_version == -1 and reply.engine == f"local:{tiny_model_dir}"
    finally:
        app.state.engine.stop()
        local.close()


def test_an_agent_on_an_in_process_engine_yields_aligned_samples(tiny_model_dir: Path) -> None:
    async def go():
        players = EnginePlayers({"A": Engine(tiny_model_dir, weight_version=3)})
        a = AgentPlayer(agent="A")
        sampling = {a: SamplingParams(temperature=1.0, max_new_tokens=3, seed=11)}
        try:
            return [await players.play(TicTacToe({}, 2), f"e{i}", "g", {"X": a, "O": Scripted(name="random")},
                                       sampling, "train", random.Random(2)) for i in range(2)]
        finally:
            players.stop()

    first, second = asyncio.run(go())
    assert first.transcript == second.transcript  # seeded: the same game twice
    samples = first.samples({"A": 2})
    assert len(samples) == 1 and samples[0].agent == "A" and samples[0].role == "X" and samples[0].group_samples == 2
    s = samples[0]
    assert len(s.tokens) == len(s.loss_mask) == len(s.rollout_logprobs) and set(s.weight_versions) == {3}
    assert first.record()["roles"] == {"X": "A", "O": "scripted:random"}
    assert first.samples({"B": 2}) == []  # only the agents asked for


def test_pool_players_are_drawn_before_play() -> None:
    with pytest.raises(ValueError, match="pool players must be drawn"):
        asyncio.run(play_episode(TicTacToe({}, 0), "e", "g", {"X": Pool(agent="A"), "O": Scripted(name="random")},
                                 {}, {}, None, "eval"))


def test_evaluation_is_seeded_and_alternates_sides(tiny_model_dir: Path) -> None:
    env_cfg = EnvironmentConfig(name="tictactoe", roles={"X": "A", "O": "A"}, alternate_roles=True)
    a = AgentPlayer(agent="A")

    async def go():
        players = EnginePlayers({"A": Engine(tiny_model_dir)})

        async def play(env, gid, roles, sampling, rng):
            return await players.play(env, gid, gid, roles, sampling, "eval", rng)

        base = SamplingParams(max_new_tokens=2)
        try:
            results = await play_eval(TicTacToe, env_cfg, a, ["X", "O"], "random", 6, base, 1.0, play)
            again = await evaluate_player(TicTacToe, env_cfg, a, ["X", "O"], "random", 6, base, 1.0, play)
            return results, again
        finally:
            players.stop()

    results, report = asyncio.run(go())
    assert [mine for mine, _ in results] == ["X", "O"] * 3
    assert all(r.roles[mine] == a and r.roles[other] == Scripted(name="random")
               for mine, r in results for other in ("X", "O") if other != mine)
    assert report["episodes"] == 6 and report["wins"] + report["draws"] + report["losses"] == 6
    assert report["per_role"]["X"] is not None and report["per_role"]["O"] is not None
