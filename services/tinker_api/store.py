"""Everything the Tinker API service must not lose, in Redis: sessions, models, requests, results.

* ``tk:req:{rid}`` (hash): one request as received (``kind``, ``scope``, ``seq``, ``body``,
  ``ctype``) and, once run, its result (``state`` = pending | done | failed, ``result``,
  ``rctype``). A request is written here BEFORE the client gets its ``request_id``.
* ``tk:ops:{scope}`` (hash seq -> rid): a model's (or sampling session's) operation log.
  The request id is derived from (scope, seq), and ``submit`` writes the request only if
  that id is new (one Lua script), so a retried request with a seen ``seq_id`` changes nothing.
* ``tk:model:{model_id}`` / ``tk:sampler:{sampling_session_id}`` / ``tk:session:{id}``
  (hashes of JSON fields): what each is, so they can be rebuilt after a restart.
* ``tk:pending`` (set): requests without a result yet (a restart runs them).
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis

_SUBMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""


def request_id(scope: str, seq: int | str) -> str:
    return f"{scope}#{seq}"


class Store:
    def __init__(self, url: str) -> None:
        self.redis = aioredis.Redis.from_url(url, decode_responses=False)
        self._submit = self.redis.register_script(_SUBMIT)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # -- requests -----------------------------------------------------------------------
    async def submit(self, kind: str, scope: str, seq: int, body: bytes, ctype: str) -> tuple[str, bool]:
        """Record a request under (scope, seq); returns (request_id, True if new, False if a retry)."""
        rid = request_id(scope, seq)
        fields = {"kind": kind, "scope": scope, "seq": str(seq), "body": body, "ctype": ctype,
                  "state": "pending", "at": str(time.time())}
        flat: list[Any] = [x for kv in fields.items() for x in kv]
        created = await self._submit(keys=[f"tk:req:{rid}", f"tk:ops:{scope}", "tk:pending"],
                                     args=[str(seq), rid, *flat])
        return rid, bool(created)

    async def request(self, rid: str) -> dict[str, bytes] | None:
        raw = await self.redis.hgetall(f"tk:req:{rid}")
        return {k.decode(): v for k, v in raw.items()} if raw else None

    async def op_at(self, scope: str, seq: int) -> str | None:
        rid = await self.redis.hget(f"tk:ops:{scope}", str(seq))
        return rid.decode() if rid is not None else None

    async def finish(self, rid: str, ok: bool, result: bytes, rctype: str) -> None:
        """Store a request's result (or its error) and take it off the pending set, in one transaction."""
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(f"tk:req:{rid}", mapping={"state": "done" if ok else "failed", "result": result,
                                             "rctype": rctype, "done_at": str(time.time())})
            p.srem("tk:pending", rid)
            await p.execute()

    async def pending(self) -> list[str]:
        return sorted(x.decode() for x in await self.redis.smembers("tk:pending"))

    # -- records (JSON) -----------------------------------------------------------------
    async def put(self, kind: str, key: str, record: dict[str, Any], only_new: bool = False) -> bool:
        name = f"tk:{kind}:{key}"
        if only_new:
            return bool(await self.redis.hsetnx(name, "json", json.dumps(record)))
        await self.redis.hset(name, "json", json.dumps(record))
        return True

    async def get(self, kind: str, key: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(f"tk:{kind}:{key}", "json")
        return json.loads(raw) if raw is not None else None

    async def touch(self, kind: str, key: str, field: str, value: str) -> None:
        await self.redis.hset(f"tk:{kind}:{key}", field, value)

    async def field(self, kind: str, key: str, field: str) -> str | None:
        raw = await self.redis.hget(f"tk:{kind}:{key}", field)
        return raw.decode() if raw is not None else None

    async def count(self, name: str, n: int = 1) -> int:
        return int(await self.redis.hincrby("tk:telemetry", name, n))
