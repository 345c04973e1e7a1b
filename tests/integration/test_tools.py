"""Tools in episodes: the call format, the built-in tools and their limits, and tool turns in the episode loop
(tool results as context with loss mask 0, the view token-exact, no gradient through a tool result)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.contracts.messages import GenerateReply, GenerateRequest, SamplingParams
from services.contracts.players import AgentPlayer, Player
from services.envs.registry import load_environment
from services.envs.tools.base import Limits, ToolBox, ToolCall, ToolOutcome, ToolParams, load_tool
from services.envs.tools.calculator import evaluate
from services.envs.tools.calls import ToolCallError, parse_tool_call
from services.envs.tools.repl import can_confine
from services.play.episode import play_episode
from services.training.grpo import token_logprobs
from tests.helpers import REPO
from tests.unit.test_render import CHATML, byte_tokenizer


async def run(box: ToolBox, reply: str) -> tuple[str, bool]:
    call = box.parse(reply)
    assert call is not None
    out = await box.run(call)
    return out.result, out.error


def test_the_tool_call_formats() -> None:
    call = parse_tool_call('Let me see.<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
                           '</tool_call>')
    assert call == ToolCall("calculator", {"expression": "2+3"})
    encoded = '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_call(encoded) == ToolCall("x", {"a": 1})
    assert parse_tool_call("CALL calculator 17 * 23") == ToolCall("calculator", {}, text="17 * 23")
    assert parse_tool_call('first line\nCALL files {"op": "list"}') == ToolCall("files", {"op": "list"})
    assert parse_tool_call("the answer is 42") is None
    for bad in ("<tool_call>{oops</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "x", "arguments": [1]}</tool_call>', "CALL x {not json"):
        with pytest.raises(ToolCallError):
            parse_tool_call(bad)


async def test_the_calculator_does_arithmetic_and_nothing_else() -> None:
    assert evaluate("17*23+4") == 395 and evaluate("2^10") == 1024 and evaluate("sqrt(16)") == 4.0
    box = ToolBox(("calculator",))
    try:
        assert await run(box, "CALL calculator (1+2)*3") == ("9", False)
        for bad in ("__import__('os').system('true')", "().__class__", "x", "9**9**9", "1/0", "'a'*3"):
            call = f'{{"name": "calculator", "arguments": {{"expression": "{bad}"}}}}'
            result, error = await run(box, f"<tool_call>{call}</tool_call>")
            assert error and result.startswith("error:"), bad
    finally:
        box.close()


async def test_unknown_and_malformed_calls_are_answered_not_raised() -> None:
    box = ToolBox(("calculator",))
    try:
        assert await run(box, "CALL shell rm -rf /") == ("error: no tool 'shell' (tools: calculator)", True)
        result, error = await run(box, "<tool_call>{bad json</tool_call>")
        assert error and "not JSON" in result and "cut off" not in result
        cut = box.parse('<tool_call>{"name": "calculator", "arguments": {"expression": "1-2"}}</tool_c', cut=True)
        assert isinstance(cut, ToolOutcome) and "cut off at its max_new_tokens" in cut.result
        with pytest.raises(ValueError, match="unknown tool 'nope'"):
            load_tool("nope")
        with pytest.raises(ValueError, match="not a Tool subclass"):
            load_tool("services.envs.tool_tasks:ToolMath")
    finally:
        box.close()


async def test_call_limits_per_turn_and_episode() -> None:
    box = ToolBox(("calculator",), Limits(per_turn=2, per_episode=3))
    try:
        box.new_turn()
        for _ in range(2):
            assert box.can_call()
            await run(box, "CALL calculator 1+1")
        assert not box.can_call()
        box.new_turn()
        assert box.can_call()
        await run(box, "CALL calculator 1+1")
        box.new_turn()
        assert not box.can_call()  # 3 in the episode
    finally:
        box.close()


async def test_scratch_files_stay_in_the_episode_directory(tmp_path: Path) -> None:
    box = ToolBox(("files",))
    outside = tmp_path / "secret.txt"
    outside.write_text("no")
    try:
        assert (await run(box, 'CALL files {"op": "write", "path": "notes/a.txt", "text": "hi"}'))[1] is False
        assert await run(box, 'CALL files {"op": "read", "path": "notes/a.txt"}') == ("hi", False)
        assert await run(box, 'CALL files {"op": "list"}') == ("notes/a.txt", False)
        (box.workdir / "link").symlink_to(outside)
        for path in ("../x", str(outside), "link", "notes/../../x"):
            result, error = await run(box, f'CALL files {{"op": "read", "path": "{path}"}}')
            assert error and "outside" in result, path
        workdir = box.workdir
    finally:
        box.close()
    assert not workdir.exists()


async def test_the_python_session_keeps_state_and_its_limits_hold() -> None:
    box = ToolBox(("python",), Limits(seconds=3.0))
    try:
        assert await run(box, "CALL python x = 6") == ("(no output)", False)
        assert await run(box, "CALL python x * 7") == ("42\n", False)
        assert "MemoryError" in (await run(box, "CALL python b = bytearray(1 << 30)"))[0]  # RLIMIT_AS 256 MiB
        assert (await run(box, "CALL python x"))[0] == "6\n"  # the session survived the MemoryError
        result, error = await run(box, "CALL python while True: pass")
        assert error and "ran past" in result
        assert "NameError" in (await run(box, "CALL python x"))[0]  # a fresh session after the kill
        if can_confine():
            connect = 'CALL python import socket; socket.create_connection(("10.0.0.1", 80), timeout=1)'
            net = (await run(box, connect))[0]
            assert "unreachable" in net.lower() or "Errno" in net
            assert "Read-only file system" in (await run(box, "CALL python open('/tmp/tandem-escape', 'w')"))[0]
            assert not await asyncio.to_thread(Path("/tmp/tandem-escape").exists)
            assert (await run(box, "CALL python open('mine.txt', 'w').write('ok')"))[0] == "2\n"
            assert (box.workdir / "mine.txt").read_text() == "ok"  # its own directory stays writable
    finally:
        box.close()


async def test_search_finds_the_catalogue_entry() -> None:
    box = ToolBox(("search",))
    try:
        result, error = await run(box, '<tool_call>{"name": "search", "arguments": {"query": "oak plank price"}}'
                                 "</tool_call>")
        assert not error and result.startswith("[Oak Plank]") and "coins per unit" in result
        assert (await run(box, 'CALL search {"query": "x", "k": 9}'))[1]
    finally:
        box.close()


def test_tool_params_name_a_bad_tool() -> None:
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        ToolParams(tools={"solver": ["nope"]})
    with pytest.raises(ValueError, match=r"tools\.judge: no such role"):
        load_environment("tool_math")({"tools": {"judge": ["calculator"]}}, 0)
    env = load_environment("tool_math")({"tools": {"solver": ["calculator"]}}, 0)
    assert env.tool_names("solver") == ("calculator",)


class ScriptedModel:
    """A model player that replies with fixed texts (encoded with its tokenizer, then the end-of-turn token)."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        self.tok, self.replies = tokenizer, list(replies)

    async def __call__(self, player: Player, request: GenerateRequest) -> GenerateReply:
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateReply(request_id=request.id, agent=request.agent, episode_id=request.episode_id,
                             turn=request.turn, output_ids=ids, output_logprobs=[-0.5] * len(ids),
                             finish_reason="stop", weight_version=3, engine="e")


def play(env: Any, tokenizer: Any, replies: list[str], roles: dict[str, Player] | None = None) -> Any:
    roles = roles or {"solver": AgentPlayer(agent="A")}
    players = {p for p in roles.values() if isinstance(p, AgentPlayer)}
    return asyncio.run(play_episode(env, "ep", "g", roles, dict.fromkeys(players, tokenizer),
                                    dict.fromkeys(players, SamplingParams(max_new_tokens=64)),
                                    ScriptedModel(tokenizer, replies), rng=random.Random(0)))


def test_a_tool_turn_masks_the_result_and_stays_token_exact() -> None:
    tok = byte_tokenizer(["<|im_start|>", "<|im_end|>"], "<|im_end|>", CHATML)
    env = load_environment("tool_math")({"system": {"solver": "Solve."}}, 1)
    answer = env.task.reference
    expression = env.task.prompt  # not arithmetic: the calculator answers with an error, and the episode goes on
    replies = ['<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
               f"CALL python print({answer})", f'CALL calculator "{expression[:10]}', answer]
    result = play(env, tok, replies)
    turn = result.transcript[0]
    assert [c["name"] for c in turn["tool_calls"]] == ["calculator", "python", "calculator"]
    assert turn["tool_calls"][0]["result"] == "42" and turn["tool_calls"][1]["result"] == f"{answer}\n"
    assert turn["tool_calls"][2]["error"] and turn["generations"] == 4 and turn["text"] == answer
    assert result.rewards == {"solver": 1.0} and result.summary["tool_calls"] == 3
    view = result.views["solver"]
    messages = [{"role": "system", "content": env.system_prompt("solver") + "\n\n" + ToolBox(("calculator",
                 "python")).describe()}, {"role": "user", "content": env.observation("solver")}]
    for reply, call in zip(replies, [*turn["tool_calls"], None], strict=True):
        messages.append({"role": "assistant", "content": reply})
        if call is not None:
            messages.append({"role": "tool", "content": call["result"]})
    full = tok.apply_chat_template(messages, tokenize=False)
    assert view.tokens == tok.encode(full.removesuffix("\n"), add_special_tokens=False)  # token-exact
    masked = tok.decode([t for t, m in zip(view.tokens, view.loss_mask, strict=True) if m])
    assert masked == "".join(r + "<|im_end|>" for r in replies)  # only the generations are trained
    for call in turn["tool_calls"]:  # every tool result's tokens sit in the mask-0 context
        text = "<|im_start|>tool\n" + call["result"] + "<|im_end|>"
        ids = tok.encode(text, add_special_tokens=False)
        starts = [i for i in range(len(view.tokens)) if view.tokens[i:i + len(ids)] == ids]
        assert starts and all(view.loss_mask[i] == 0 for s in starts for i in range(s, s + len(ids)))
    sample = result.samples({"A": 1})[0]
    assert len(sample.turn_rewards) == 4 and sample.turn_rewards[-1] == 1.0  # one span per generation
    assert sample.weight_versions == [3, 3, 3, 3]


def test_past_the_turn_limit_a_call_is_the_final_reply() -> None:
    tok = byte_tokenizer(["<|im_start|>", "<|im_end|>"], "<|im_end|>", CHATML)
    env = load_environment("tool_math")({"max_tool_calls_per_turn": 1}, 1)
    result = play(env, tok, ["CALL calculator 1+1", "CALL calculator 2+2"])
    assert len(result.transcript[0]["tool_calls"]) == 1
    assert result.transcript[0]["text"] == "CALL calculator 2+2" and result.rewards["solver"] == 0.0  # 2: wrong


def test_a_tool_result_carries_no_gradient(tiny_model_dir: Path) -> None:
    """A policy-gradient loss over a tool turn's sample: the logits that predict the tool result's tokens get
    exactly zero gradient; those that predict the generated tokens do not."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    env = load_environment("tool_math")({"system": {"solver": ""}}, 2)
    result = play(env, tok, ["CALL calculator 6*7", env.task.reference])
    view = result.views["solver"]
    tokens = torch.tensor([view.tokens])
    mask = torch.tensor([view.loss_mask[1:]], dtype=torch.float)
    logits = model(tokens).logits[:, :-1].detach().requires_grad_(True)
    logp = token_logprobs(logits, tokens[:, 1:], 1.0)
    (-(logp * mask).sum() / mask.sum()).backward()
    grad = logits.grad[0].abs().sum(-1)
    result_ids = tok.encode("42", add_special_tokens=False)
    tool_at = [i for i in range(len(view.tokens)) if view.tokens[i:i + len(result_ids)] == result_ids
               and view.loss_mask[i] == 0]
    assert tool_at, "the tool result is in the view"
    for pos in tool_at:
        for i in range(pos, pos + len(result_ids)):
            assert grad[i - 1] == 0.0  # the logits at i-1 predict token i, a tool-result token
    trained = [i - 1 for i, m in enumerate(view.loss_mask) if m and i > 0]
    assert all(grad[i] > 0 for i in trained)
    model.zero_grad()
    out = model(tokens).logits[:, :-1]
    loss = -(token_logprobs(out, tokens[:, 1:], 1.0) * mask).sum()
    loss.backward()
    emb = model.get_input_embeddings().weight.grad
    assert emb is not None and float(emb.abs().sum()) > 0  # a real backward through the model


def test_tool_relay_rules_with_scripted_players() -> None:
    env_cls = load_environment("tool_relay")
    tok = byte_tokenizer(["<|im_start|>", "<|im_end|>"], "<|im_end|>", CHATML)
    from services.contracts.players import Scripted
    for seed in range(6):
        env = env_cls({}, seed)
        oracle = play(env, tok, [], {"researcher": Scripted(name="oracle"), "buyer": Scripted(name="trusting")})
        assert oracle.rewards == {"researcher": 1.5, "buyer": 1.0} and oracle.summary["report_right"] == 1
        env = env_cls({}, seed)
        wrong = play(env, tok, [], {"researcher": Scripted(name="wrong"), "buyer": Scripted(name="oracle")})
        assert wrong.rewards == {"researcher": 1.0, "buyer": 1.0} and wrong.summary["report_right"] == 0
    env = env_cls({"report_bonus": 0.0}, 0)
    price = env.item["price"]
    replies = [f'<tool_call>{{"name": "search", "arguments": {{"query": "{env.item["title"]}"}}}}</tool_call>',
               f"CALL calculator {price}*{env.units}", f"Total: {env.total}", "maybe"]
    model = play(env, tok, replies, {"researcher": AgentPlayer(agent="R"), "buyer": AgentPlayer(agent="B")})
    calls = model.transcript[0]["tool_calls"]
    assert f"{price} coins per unit" in calls[0]["result"] and calls[1]["result"] == str(env.total)
    assert model.rewards == {"researcher": 0.0, "buyer": -0.5} and model.transcript[1]["invalid"]
    assert "tool_calls" not in model.transcript[1]  # the buyer has no tools
    assert all(m == 0 for m in model.views["buyer"].loss_mask[:-6])


async def test_tool_math_demonstrations_call_the_calculator_and_answer_right() -> None:
    """The solver's demonstration: the calculator on the problem's arithmetic (each of the three kinds), whose
    result is the answer, then the integer alone; a role it cannot demonstrate, a tool the config does not give
    and a dataset's task (no arithmetic to give the calculator) are refused."""
    env_cls = load_environment("tool_math")
    box = ToolBox(("calculator",))
    try:
        prompts = set()
        for seed in range(12):
            env = env_cls({}, seed)
            prompts.add(env.task.prompt.split()[1])
            result, error = await run(box, env.demonstration("solver", 0))
            assert not error and result == str(env.task.answer) == env.demonstration("solver", 1)
            assert (await env.step("solver", env.demonstration("solver", 1))).rewards == {"solver": 1.0}
        assert len(prompts) >= 3  # the three kinds of problem
    finally:
        box.close()
    with pytest.raises(ValueError, match="cannot demonstrate role 'critic'"):
        env_cls({}, 0).demonstration("critic", 0)
    with pytest.raises(ValueError, match="calls calculator, which environment.params.tools does not give it"):
        env_cls({"tools": {"solver": ["python"]}}, 0).demonstration("solver", 0)
    dataset = {"path": str(REPO / "data" / "samples" / "word_problems.jsonl")}
    with pytest.raises(ValueError, match="a task from environment.dataset has no arithmetic"):
        env_cls({"dataset": dataset}, 0).demonstration("solver", 0)


async def test_a_buyer_with_the_calculator_demonstrates_budget_minus_the_report() -> None:
    """Given the calculator, the buyer's demonstration subtracts the report's total from its budget (its system
    message says so), then decides right: BUY exactly when the difference is not negative; without it, the
    decision alone."""
    env_cls = load_environment("tool_relay")
    params = {"tools": {"researcher": ["search", "calculator"], "buyer": ["calculator"]}}
    box = ToolBox(("calculator",))
    try:
        decisions = set()
        for seed in range(12):
            env = env_cls(params, seed)
            await env.step("researcher", env.demonstration("researcher", 2))
            result, error = await run(box, env.demonstration("buyer", 0))
            decision = env.demonstration("buyer", 1)
            assert not error and int(result) == env.budget - env.total
            assert decision == ("BUY" if int(result) >= 0 else "SKIP")
            assert (await env.step("buyer", decision)).rewards["buyer"] == 1.0
            decisions.add(decision)
        assert decisions == {"BUY", "SKIP"}
        assert "calculator" in (env.system_prompt("buyer") or "")
    finally:
        box.close()
    plain = env_cls({}, 0)
    assert plain.demonstration("buyer", 0) in ("BUY", "SKIP") and "calculator" not in plain.system_prompt("buyer")


async def test_a_plug_in_tool_and_the_time_limit_per_call() -> None:
    box = ToolBox(("tests.plugin_tool:Slow",), Limits(seconds=0.5))
    try:
        assert await run(box, "CALL slow 0") == ("awake", False)
        result, error = await run(box, 'CALL slow {"seconds": 5}')
        assert error and "longer than 0.5s" in result
    finally:
        box.close()
