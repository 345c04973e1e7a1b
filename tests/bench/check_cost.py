"""The cost of issue 12's checks and signatures, per message, scaled to the demo (docs/architecture.md §2.3).

There is no switch that turns the checks off, so no side-by-side demo run: this measures each added check
per message in one process, then multiplies by the demo's message counts (``--samples``, ``--replies``,
``--versions``; defaults from README: the demo's 3,136 episodes, 192 groups of 8 per agent, 12 versions per
agent, with a generous 9 agent turns per training episode and 5 per evaluation episode) and divides by the
demo's run wall time (``--demo-wall-s``, README: 90 s). The result is CPU seconds added over wall seconds:
an upper bound on the wall-time ratio, since the services run side by side and not every check is on the
critical path.

Measured per message (median of ``--repeats`` rounds, after a warm-up):

* wire types: decoding a typical Sample / GenerateReply with the strict types (non-negative token ids,
  finite logprobs <= 0, finite rewards) minus decoding it into a twin model without those constraints;
* the vocabulary and logprob scans (``ids_problem``, ``logprobs_problem``) the buffer and the rollout run;
* the buffer's ledger read (one HGET of the group record on an embedded Valkey) per sample;
* per published version: the rollout's ``refusal`` (HMAC compare, the commit lookup in Redis, the checksum
  recomputed over the model directory) plus the trainer's ``sign``.

    PYTHONPATH=$PWD python tests/bench/check_cost.py --model build/test-cache/warm-*/model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import typing
from pathlib import Path
from typing import Annotated, Any

import redis.asyncio as aioredis
from pydantic import create_model

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from services.common.embedded_redis import EmbeddedRedis  # noqa: E402
from services.common.tokens import ids_problem, logprobs_problem  # noqa: E402
from services.common.weights_auth import refusal, sign, weights_checksum  # noqa: E402
from services.contracts.codec import decode, encode  # noqa: E402
from services.contracts.messages import GenerateReply, Sample, WeightsUpdate  # noqa: E402
from services.contracts.streams import Streams  # noqa: E402


def plain(tp: Any) -> Any:
    """``tp`` without its constraints (Annotated metadata dropped, recursively)."""
    if typing.get_origin(tp) is Annotated:
        return plain(typing.get_args(tp)[0])
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (list, dict) and args:
        return origin[tuple(plain(a) for a in args)] if len(args) > 1 else origin[plain(args[0])]
    return tp


def lax_twin(model: Any) -> Any:
    fields = {n: (plain(f.annotation), f.default_factory() if f.default_factory else f.default)
              for n, f in model.model_fields.items() if not f.is_required()}
    fields |= {n: (plain(f.annotation), ...) for n, f in model.model_fields.items() if f.is_required()}
    return create_model(f"Lax{model.__name__}", __config__=model.model_config, **fields)


def typical(n_tokens: int) -> tuple[Sample, GenerateReply]:
    rng = random.Random(0)
    mask = [1 if i % 10 > 6 else 0 for i in range(n_tokens)]
    sample = Sample(agent="A", role="X", episode_id="e" * 32, group_id="g" * 16, group_samples=8,
                    tokens=[rng.randrange(300) for _ in range(n_tokens)], loss_mask=mask,
                    rollout_logprobs=[-rng.random() if m else 0.0 for m in mask], reward=1.0,
                    weight_versions=[3, 3, 4], engines=["A-0"] * 3, reply_ids=["r" * 32] * 3)
    reply = GenerateReply(request_id="r" * 32, agent="A", episode_id="e" * 32, turn=3, output_ids=[5, 6, 7, 8],
                          output_logprobs=[-0.1, -0.2, -0.3, -0.4], finish_reason="length", weight_version=3,
                          engine="http://127.0.0.1:1")
    return sample, reply


def per_call(fn: Any, repeats: int, inner: int) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` rounds of ``inner`` calls."""
    fn()
    rounds = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        rounds.append((time.perf_counter() - t) / inner)
    return statistics.median(rounds)


async def redis_costs(url: str, model_dir: Path, repeats: int) -> dict[str, float]:
    r = aioredis.Redis.from_url(url)
    s = Streams("cost")
    await r.hset(s.group_ledger("A"), "g", json.dumps({"state": "emitted", "samples": ["x" * 32] * 8}))
    checksum = await asyncio.to_thread(weights_checksum, model_dir)
    secret = b"s" * 32
    w = WeightsUpdate(agent="A", weight_version=1, path=str(model_dir), checksum=checksum,
                      signature=sign(secret, "A", 1, str(model_dir), checksum))
    await r.set(s.published_weight_version("A"), 1)
    await r.rpush(s.train_log("A"), json.dumps({"version": 1, "path": str(model_dir), "checksum": checksum}))
    hget, checks = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(200):
            await r.hget(s.group_ledger("A"), "g")
        hget.append((time.perf_counter() - t) / 200)
        t = time.perf_counter()
        assert await refusal(r, s, secret, w) is None
        checks.append(time.perf_counter() - t)
    await r.aclose()
    return {"ledger_hget_s": statistics.median(hget), "weights_refusal_s": statistics.median(checks)}


def measure(args: argparse.Namespace) -> dict[str, float]:
    sample, reply = typical(args.tokens)
    raw_s, raw_r = encode(sample), encode(reply)
    lax_s, lax_r = lax_twin(Sample), lax_twin(GenerateReply)
    rep, inner = args.repeats, 200
    out = {
        "sample_strict_decode_s": per_call(lambda: decode(raw_s, Sample), rep, inner),
        "sample_lax_decode_s": per_call(lambda: decode(raw_s, lax_s), rep, inner),
        "reply_strict_decode_s": per_call(lambda: decode(raw_r, GenerateReply), rep, inner),
        "reply_lax_decode_s": per_call(lambda: decode(raw_r, lax_r), rep, inner),
        "sample_scan_s": per_call(lambda: ids_problem(sample.tokens, 320, "tokens"), rep, inner),
        "reply_scan_s": per_call(lambda: (ids_problem(reply.output_ids, 320, "o"),
                                          logprobs_problem(reply.output_logprobs, "o")), rep, inner),
        "sign_s": per_call(lambda: sign(b"s" * 32, "A", 1, "/p", "c" * 64), rep, inner),
    }
    with EmbeddedRedis(appendonly=False) as server:
        out |= asyncio.run(redis_costs(server.url, args.model, rep))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a model directory of the demo's size")
    p.add_argument("--tokens", type=int, default=400, help="tokens of a typical sample (400: generous for ttt)")
    p.add_argument("--samples", type=int, default=2 * 192 * 8)
    p.add_argument("--replies", type=int, default=2 * 192 * 8 * 9 + 1600 * 5)
    p.add_argument("--versions", type=int, default=24)
    p.add_argument("--demo-wall-s", type=float, default=90.0)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    m = measure(args)
    per_sample = max(0.0, m["sample_strict_decode_s"] - m["sample_lax_decode_s"]) + m["sample_scan_s"] \
        + m["ledger_hget_s"]
    per_reply = max(0.0, m["reply_strict_decode_s"] - m["reply_lax_decode_s"]) + m["reply_scan_s"]
    per_version = m["weights_refusal_s"] + m["sign_s"]
    added = args.samples * per_sample + args.replies * per_reply + args.versions * per_version
    print(json.dumps({"per_message_us": {k: round(v * 1e6, 2) for k, v in m.items()},
                      "per_sample_us": round(per_sample * 1e6, 2), "per_reply_us": round(per_reply * 1e6, 2),
                      "per_version_ms": round(per_version * 1e3, 3),
                      "counts": {"samples": args.samples, "replies": args.replies, "versions": args.versions},
                      "added_cpu_s": round(added, 3), "demo_wall_s": args.demo_wall_s,
                      "ratio_upper_bound": round((args.demo_wall_s + added) / args.demo_wall_s, 4)}, indent=2))


if __name__ == "__main__":
    main()
