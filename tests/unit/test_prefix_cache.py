"""The embedded engine's prefix cache: a dialogue's later turns reuse its earlier turns' KV exactly."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.inference.generator import Engine, GenRequest
from services.inference.prefix_cache import PrefixCache


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    cached, plain = Engine(tiny_model_dir, prefix_cache_mb=16), Engine(tiny_model_dir)
    yield cached, plain
    cached.stop()
    plain.stop()


def _req(rid: str, ids: list[int], seed: int, n: int = 6) -> GenRequest:
    return GenRequest(rid=rid, input_ids=list(ids), temperature=1.0, max_new_tokens=n, seed=seed, ignore_eos=True)


def _full_logprobs(engine: Engine, prompt: list[int], output: list[int]) -> list[float]:
    seq = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = engine.model(seq).logits[:, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(2, seq[:, 1:, None])[0, :, 0]
    return lp[len(prompt) - 1:].tolist()


async def _dialogues(engine: Engine, n: int, turns: int, seed: int) -> list[list[GenRequest]]:
    """``n`` dialogues played together: each turn's prompt is the last prompt, its reply and new tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(4, 9))] for _ in range(n)]
    done: list[list[GenRequest]] = [[] for _ in range(n)]
    for t in range(turns):
        reqs = [_req(f"d{i}-{t}", p, seed=1000 * t + i) for i, p in enumerate(prompts)]
        for i, r in enumerate(await engine.generate_many(reqs)):
            done[i].append(r)
            prompts[i] = [*r.input_ids, *r.output_ids, *[rng.randrange(3, engine.vocab_size) for _ in range(3 + i)]]
    return done


async def test_reuse_is_exact_in_batches(engines: tuple[Engine, Engine]) -> None:
    """Batched dialogues (rows with and without a cached prefix in one prefill) draw the same tokens as the
    engine that re-prefills, with logprobs equal to a full forward's within 1e-4; later turns prefill only
    their new tokens."""
    cached, plain = engines
    before = dict(cached.stats)
    with_cache = await _dialogues(cached, n=4, turns=4, seed=1)
    without = await _dialogues(plain, n=4, turns=4, seed=1)
    for dial_c, dial_p in zip(with_cache, without, strict=True):
        for rc, rp in zip(dial_c, dial_p, strict=True):
            assert rc.output_ids == rp.output_ids
            assert max(abs(a - b) for a, b in zip(rc.logprobs, rp.logprobs, strict=True)) < 1e-4
            full = _full_logprobs(cached, rc.input_ids, rc.output_ids)
            assert max(abs(a - b) for a, b in zip(rc.logprobs, full, strict=True)) < 1e-4
    reused = cached.stats["cached_tokens"] - before["cached_tokens"]
    fed = cached.stats["prefill_tokens"] - before["prefill_tokens"]
    prompt_tokens = sum(len(r.input_ids) for d in with_cache for r in d)
    assert reused + fed == prompt_tokens
    # turn t > 0 feeds its new tokens and the previous reply's last token only
    new_tokens = sum(len(d[0].input_ids) + sum(3 + i + 1 for _ in d[1:]) for i, d in enumerate(with_cache))
    assert fed == new_tokens


async def test_mixed_batch_matches_alone(engines: tuple[Engine, Engine]) -> None:
    """A cached row and a fresh row prefilled together give what each gives alone on the plain engine."""
    cached, plain = engines
    first = await cached.generate(_req("m0", [5, 6, 7, 8, 9], seed=3))
    follow = [*first.input_ids, *first.output_ids, 11, 12]
    fresh = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    hits = cached.prefix.stats["hits"]
    a, b = await cached.generate_many([_req("m1", follow, seed=4), _req("m2", fresh, seed=5)])
    assert cached.prefix.stats["hits"] == hits + 1
    a0, b0 = await plain.generate(_req("p1", follow, seed=4)), await plain.generate(_req("p2", fresh, seed=5))
    for x, y in ((a, a0), (b, b0)):
        assert x.output_ids == y.output_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4


async def test_weight_load_clears(engines: tuple[Engine, Engine], tiny_model_dir: Path) -> None:
    cached, _ = engines
    await cached.generate(_req("w0", [5, 6, 7], seed=1))
    assert len(cached.prefix) > 0
    await cached.update_weights(str(tiny_model_dir), 7)
    assert len(cached.prefix) == 0 and cached.prefix.nbytes == 0
    r = await cached.generate(_req("w1", [5, 6, 7, 1, 2], seed=1))
    assert r.weight_version == 7


def test_store_is_bounded_lru_and_keeps_the_longest() -> None:
    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(1, n, 4), torch.zeros(1, n, 4))]

    per_token = 2 * 4 * 4
    store = PrefixCache(max_bytes=10 * per_token)
    store.store([1, 2, 3], kv(3))
    store.store([1, 2, 3, 4, 5], kv(5))  # extends the first: it replaces it
    assert len(store) == 1 and store.nbytes == 5 * per_token
    assert store.lookup([1, 2, 3, 9])[0] == 3
    assert store.lookup([1, 2, 3, 4, 5])[0] == 4  # never the whole prompt: its last token's logits are needed
    store.store([7, 8, 9, 10], kv(4))
    store.lookup([1, 2, 3, 4, 5, 6])  # touches the first entry: the second is now the least recently used
    store.store([20, 21, 22], kv(3))  # 12 tokens > 10: the LRU entry goes
    assert store.lookup([7, 8, 9, 10, 11])[0] == 0 and store.stats["evicted"] == 1
    assert store.nbytes <= store.max_bytes
    store.store(list(range(11)), kv(11))  # larger than the whole store: not kept
    assert store.lookup([*range(11), 99])[0] == 0 and len(store) == 2
