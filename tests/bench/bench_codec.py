"""Codec benchmark: msgpack vs orjson on a typical Sample payload, side by side in one run.

This is how the bus serialisation was chosen (services/contracts/codec.py).
"""

from __future__ import annotations

import random
import timeit

import msgpack
import orjson

from services.contracts.messages import Sample


def typical_sample(n_tokens: int = 400) -> dict:
    rng = random.Random(0)
    mask = [1 if i % 10 > 6 else 0 for i in range(n_tokens)]
    return Sample(agent="A", role="X", episode_id="e" * 32, group_id="g" * 16, group_samples=8,
                  tokens=[rng.randrange(300) for _ in range(n_tokens)], loss_mask=mask,
                  rollout_logprobs=[-rng.random() if m else 0.0 for m in mask], reward=1.0,
                  weight_versions=[3, 3, 4], engines=["A-0"] * 3, reply_ids=["r" * 32] * 3,
                  ).model_dump(mode="python")


def run(repeats: int = 3000) -> dict[str, float]:
    data = typical_sample()
    out: dict[str, float] = {}
    for name, enc, dec in (("msgpack", msgpack.packb, msgpack.unpackb), ("orjson", orjson.dumps, orjson.loads)):
        raw = enc(data)
        out[f"{name}_bytes"] = len(raw)
        out[f"{name}_encode_us"] = min(timeit.repeat(lambda e=enc: e(data), number=repeats, repeat=3)) / repeats * 1e6
        best = min(timeit.repeat(lambda d=dec, r=raw: d(r), number=repeats, repeat=3))
        out[f"{name}_decode_us"] = best / repeats * 1e6
    out["size_ratio_msgpack_vs_orjson"] = out["msgpack_bytes"] / out["orjson_bytes"]
    out["roundtrip_ratio_msgpack_vs_orjson"] = (out["msgpack_encode_us"] + out["msgpack_decode_us"]) / (
        out["orjson_encode_us"] + out["orjson_decode_us"])
    return out


if __name__ == "__main__":
    for k, v in run().items():
        print(f"{k}: {v:.3f}")
