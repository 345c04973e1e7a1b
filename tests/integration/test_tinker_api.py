"""The Tinker API service against the UNMODIFIED official SDK (tinker 0.38), on a live ``tandem serve``.

One server (a real process on a loopback port, the suite's Redis, the tiny demo model as a
local base model) serves the module; every test opens its own SDK session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from services.common.embedded_redis import EmbeddedRedis
from tests.helpers import tinker_server, tinker_service
from tests.tinker_server import TinkerServer

KEY = "tml-tandem-test"
IDS = [60 + (7 * i) % 50 for i in range(24)]


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    url = redis_server.url.rsplit("/", 1)[0] + "/3"  # a database of its own: the suite's flushes never hit it
    with tinker_server(url, tmp_path_factory.mktemp("tinker")) as srv:
        yield srv


@pytest.fixture
def service(server: TinkerServer) -> Iterator[tinker.ServiceClient]:
    with tinker_service(server.url, KEY) as client:
        yield client


def sft_datum(ids: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def forward_logprobs(tc: tinker.TrainingClient, ids: list[int]) -> np.ndarray:
    out = tc.forward([sft_datum(ids)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def train_steps(tc: tinker.TrainingClient, steps: int, lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward([sft_datum(IDS)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def local_logprobs(model_dir: str | Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).numpy()


def test_forward_matches_transformers_and_loss_falls(service: tinker.ServiceClient, tiny_model_dir: Path):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    info = tc.get_info()
    assert info.lora_rank == 4 and info.model_data.model_name == str(tiny_model_dir)
    # a fresh adapter (B = 0) is the base model: the forward equals transformers' own computation
    np.testing.assert_allclose(forward_logprobs(tc, IDS), local_logprobs(tiny_model_dir, IDS), atol=1e-4)
    losses = train_steps(tc, 5)
    assert losses[-1] < losses[0] * 0.9, losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_sampler_snapshot_logprobs_and_isolation(service: tinker.ServiceClient, server: TinkerServer,
                                                 tiny_model_dir: Path):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=1).result()
    train_steps(tc, 2)
    saved = tc.save_weights_for_sampler("snap").result()
    sampler = service.create_sampling_client(model_path=saved.path).result()
    trained = forward_logprobs(tc, IDS)
    # the exported snapshot, loaded by plain transformers, is the trainer's weights
    model_id, _, name = saved.path[len("tinker://"):].split("/")
    snap_dir = server.data_dir / "runs" / model_id / "sampler_weights" / name
    np.testing.assert_allclose(local_logprobs(snap_dir, IDS), trained, atol=1e-4)
    # prompt logprobs and sampled-token logprobs from the engine equal the trainer's forward
    prompt_lps = sampler.compute_logprobs(types.ModelInput.from_ints(IDS)).result()
    assert prompt_lps[0] is None
    np.testing.assert_allclose(np.array(prompt_lps[1:], dtype=np.float32), trained, atol=1e-4)
    params = types.SamplingParams(max_tokens=6, seed=7, temperature=1.0, stop=[])
    first = sampler.sample(types.ModelInput.from_ints(IDS[:8]), 2, params).result()
    assert len(first.sequences) == 2 and all(len(s.tokens) == 6 for s in first.sequences)
    assert len({s.sequence_id for s in first.sequences}) == 2
    seq = first.sequences[0]
    full = IDS[:8] + list(seq.tokens)
    np.testing.assert_allclose(np.array(seq.logprobs), forward_logprobs(tc, full)[7:], atol=1e-4)
    # training goes on: the snapshot's sampler does not move; the base model samples meanwhile
    train_steps(tc, 2)
    again = sampler.sample(types.ModelInput.from_ints(IDS[:8]), 2, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    np.testing.assert_allclose(again.sequences[0].logprobs, seq.logprobs, atol=1e-6)
    assert not np.allclose(forward_logprobs(tc, IDS), trained, atol=1e-3)
    base = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
    base_lps = base.compute_logprobs(types.ModelInput.from_ints(IDS)).result()
    np.testing.assert_allclose(np.array(base_lps[1:], dtype=np.float32), local_logprobs(tiny_model_dir, IDS),
                               atol=1e-4)


def test_two_clients_on_one_base_stay_isolated(service: tinker.ServiceClient, tiny_model_dir: Path):
    a = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=2).result()
    b = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=8, seed=3).result()
    before_b = forward_logprobs(b, IDS)
    train_steps(a, 3)
    assert np.array_equal(forward_logprobs(b, IDS), before_b)  # bit for bit
    assert not np.allclose(forward_logprobs(a, IDS), before_b, atol=1e-3)
    train_steps(b, 1)
    assert not np.array_equal(forward_logprobs(b, IDS), before_b)


def _expected(loss_fn: str, lp: np.ndarray, q: np.ndarray, adv: np.ndarray, lo: float, hi: float,
              cfg: dict[str, float] | None = None, mask: np.ndarray | None = None) -> float:
    ratio = np.exp(lp - q)
    if loss_fn == "importance_sampling":
        return float(-(ratio * adv).sum())
    if loss_fn == "dro":  # tinker-docs.thinkingmachines.ai/tinker/losses/dro
        return float(-(lp * adv - 0.5 * (cfg or {})["beta"] * (lp - q) ** 2).sum())
    if loss_fn == "gspo":  # tinker-docs.thinkingmachines.ai/tinker/losses/gspo: one sequence ratio for every token
        keep = np.ones_like(lp, dtype=bool) if mask is None else mask != 0
        seq = np.exp((lp - q)[keep].mean())
        return float(-np.minimum(seq * adv, np.clip(seq, lo, hi) * adv).sum())
    if loss_fn == "ppo":
        return float(-np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv).sum())
    return float(-(np.clip(ratio, lo, hi) * lp * adv).sum())  # cispo


def test_each_loss_equals_a_hand_computation(service: tinker.ServiceClient, tiny_model_dir: Path):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=4).result()
    lp = forward_logprobs(tc, IDS)
    rng = np.random.default_rng(0)
    weights = rng.uniform(0, 2, lp.shape).astype(np.float32)
    ce = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(IDS[:-1]),
                                 loss_fn_inputs={"target_tokens": IDS[1:], "weights": weights})],
                    "cross_entropy").result()
    assert ce.metrics["loss:sum"] == pytest.approx(float(-(lp * weights).sum()), rel=1e-4)
    q = (lp + rng.uniform(-0.6, 0.6, lp.shape)).astype(np.float32)  # ratios inside and outside the clip
    adv = rng.normal(0, 1, lp.shape).astype(np.float32)
    rl = types.Datum(model_input=types.ModelInput.from_ints(IDS[:-1]),
                     loss_fn_inputs={"target_tokens": IDS[1:], "logprobs": q, "advantages": adv})
    for loss_fn, cfg in [("importance_sampling", None), ("ppo", None), ("cispo", None),
                         ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
                         ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.3}),
                         ("dro", {"beta": 0.05}), ("dro", {"beta": 2.0}), ("gspo", None),
                         ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05})]:
        out = tc.forward([rl], loss_fn, cfg).result()
        np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), lp, atol=1e-6)
        lo, hi = (cfg or {}).get("clip_low_threshold", 0.8), (cfg or {}).get("clip_high_threshold", 1.2)
        assert out.metrics["loss:sum"] == pytest.approx(_expected(loss_fn, lp, q, adv, lo, hi, cfg), rel=1e-4), loss_fn
    mask = (np.arange(lp.size) % 3 != 0).astype(np.float32)  # GSPO's sequence ratio over some of the tokens
    masked = types.Datum(model_input=rl.model_input, loss_fn_inputs={**rl.loss_fn_inputs, "sequence_ratio_mask": mask})
    for q_shift in (0.0, 0.5):  # a ratio inside the clip, and one outside it
        shifted = types.Datum(model_input=rl.model_input,
                              loss_fn_inputs={**masked.loss_fn_inputs, "logprobs": (lp - q_shift).astype(np.float32)})
        got = tc.forward([shifted], "gspo").result().metrics["loss:sum"]
        assert got == pytest.approx(_expected("gspo", lp, lp - q_shift, adv, 0.8, 1.2, mask=mask), rel=1e-4)
    # gradients accumulate across forward_backward calls: two halves of a batch = the whole batch at once
    twin = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=4).result()
    half = [sft_datum(IDS[:12]), sft_datum(IDS[12:])]
    tc.forward_backward(half[:1], "cross_entropy").result()
    tc.forward_backward(half[1:], "cross_entropy").result()
    twin.forward_backward(half, "cross_entropy").result()
    for client in (tc, twin):
        client.optim_step(types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)).result()
    np.testing.assert_allclose(forward_logprobs(tc, IDS), forward_logprobs(twin, IDS), atol=1e-5)


def test_bad_requests_fail_as_user_errors(service: tinker.ServiceClient, tiny_model_dir: Path, tmp_path: Path):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=5).result()
    with pytest.raises(tinker.RequestFailedError) as err:
        tc.forward([sft_datum(IDS)], "stable_reinforce").result()
    assert err.value.category == types.RequestErrorCategory.User and "loss_fn" in str(err.value)
    bad = types.Datum(model_input=types.ModelInput.from_ints(IDS[:-1]), loss_fn_inputs={"target_tokens": IDS[2:],
                                                                                          "weights": [1.0] * 22})
    tc2 = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=5).result()
    with pytest.raises(tinker.RequestFailedError) as err:
        tc2.forward_backward([bad], "cross_entropy").result()
    assert err.value.category == types.RequestErrorCategory.User and "target_tokens" in str(err.value)
    with pytest.raises(Exception, match="not a local model directory"):
        service.create_lora_training_client(base_model=str(tmp_path / "nowhere"), rank=4).result()
    with pytest.raises(Exception, match="no checkpoint"):
        service.create_sampling_client(model_path="tinker://nobody:train:0/sampler_weights/x").result()


def test_mint_two_agent_example_runs(server: TinkerServer, tiny_model_dir: Path):
    """examples/mint_two_agents.py, unmodified, on the real SDK against the live server."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(root / "examples" / "mint_two_agents.py"), "--base-url", server.url,
                          "--base-model", str(tiny_model_dir), "--steps", "2", "--group", "2"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 1:" in out.stdout and out.stdout.count("saved tinker://") == 1, out.stdout
    models = out.stdout.split(": ", 1)[1].splitlines()[0].split(", ")
    for model_id in models:  # its session finished: the named checkpoints stay, the ephemeral snapshots go
        assert (server.data_dir / "runs" / model_id / "weights").is_dir()
        assert not list((server.data_dir / "runs" / model_id / "sampler_weights").glob("ephemeral-*"))


def test_sampling_params_stop_seed_and_greedy(service: tinker.ServiceClient, tiny_model_dir: Path):
    base = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
    prompt = types.ModelInput.from_ints(IDS[:6])
    greedy = base.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result()
    toks = list(greedy.sequences[0].tokens)
    assert len(toks) == 8 and greedy.sequences[0].stop_reason == "length"
    stop_at = toks[3]
    cut = base.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_at])).result()
    assert list(cut.sequences[0].tokens) == toks[:toks.index(stop_at) + 1]
    assert cut.sequences[0].stop_reason == "stop"
    seeded = [base.sample(prompt, 3, types.SamplingParams(max_tokens=8, seed=11, stop=[])).result() for _ in range(2)]
    assert [s.tokens for s in seeded[0].sequences] == [s.tokens for s in seeded[1].sequences]
    assert len({tuple(s.tokens) for s in seeded[0].sequences}) > 1  # each sample draws its own stream


def test_a_sampler_engine_leaves_the_trainers_threads(tiny_model_dir: Path):
    """The engine sets torch to one thread; a trainer thread the service starts later must not inherit it."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from services.tinker_api.sampler import SamplerPool

    async def load(pool: SamplerPool) -> list[str]:
        async with pool.engine(str(tiny_model_dir)):
            return pool.loaded()

    threads = torch.get_num_threads()
    pool = SamplerPool(capacity=1, max_batch=4)
    try:
        assert asyncio.run(load(pool)) == [str(tiny_model_dir)]
        with ThreadPoolExecutor(1) as later:
            assert later.submit(torch.get_num_threads).result() == threads
    finally:
        pool.stop()


def test_topk_prompt_logprobs_and_the_training_context_check(service: tinker.ServiceClient, tiny_model_dir: Path):
    base = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
    out = base.sample(types.ModelInput.from_ints(IDS), 1, types.SamplingParams(max_tokens=1, stop=[]),
                      include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    top = out.topk_prompt_logprobs
    assert top is not None and len(top) == len(IDS) and top[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=torch.tensor([IDS[:-1]])).logits[0].float(), -1)
    vals, idx = full.topk(3, dim=-1)
    for i, row in enumerate(top[1:]):
        assert [t for t, _ in row] == idx[i].tolist()
        np.testing.assert_allclose([lp for _, lp in row], vals[i].numpy(), atol=1e-4)
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=6).result()
    context = model.config.max_position_embeddings
    with pytest.raises(tinker.RequestFailedError, match="context"):
        tc.forward_backward([sft_datum([IDS[0]] * (context + 2))], "cross_entropy").result()
    assert tc.forward([sft_datum(IDS)], "cross_entropy").result().metrics["loss:sum"] > 0  # the client goes on


def test_a_seeded_client_trains_deterministically(service: tinker.ServiceClient, tiny_model_dir: Path):
    runs = []
    for _ in range(2):
        tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=21).result()
        runs.append((train_steps(tc, 3), forward_logprobs(tc, IDS)))
    assert runs[0][0] == runs[1][0]  # the same losses, bit for bit
    assert np.array_equal(runs[0][1], runs[1][1])
