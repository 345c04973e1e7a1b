"""Everything the Tinker API service must not lose, in Redis: sessions, models, requests, results.

* ``tk:req:{rid}`` (hash): one request as received (``kind``, ``scope``, ``seq``, ``body``,
  ``ctype``) and, once run, its result (``state`` = pending | done | failed, ``result``,
  ``rctype``). A request is written here BEFORE the client gets its ``request_id``.
* ``tk:ops:{scope}`` (hash seq -> rid): a model's (or sampling session's) operation log.
  The request id is derived from (scope, seq), and ``submit`` writes the request only if
  that id is new (one Lua script), so a retried request with a seen ``seq_id`` changes nothing;
  a seen ``seq_id`` with a different body (its ``digest`` differs) is reported as a conflict.
  A request refused at submission is recorded at its ``seq_id`` as already failed (``refuse``),
  so the model's runner steps over it instead of waiting there.
* ``tk:model:{model_id}`` / ``tk:sampler:{sampling_session_id}`` / ``tk:session:{id}``
  (hashes of JSON fields): what each is, so they can be rebuilt after a restart.
* ``tk:pending`` (set): requests without a result yet (a restart runs them).
* ``tk:expiry`` (hash tinker path -> epoch seconds): the checkpoints saved or set with a TTL.
* ``tk:public`` (hash tinker path -> 1): the published checkpoints.
* ``tk:loss:{loss_id}``: a session's custom loss (``create_custom_loss``), as checked and stored.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import redis.asyncio as aioredis

_SUBMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local seen = redis.call('HGET', KEYS[1], 'digest')
  if seen and seen ~= ARGV[3] then return 2 end
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if ARGV[4] == 'pending' then redis.call('SADD', KEYS[3], ARGV[2]) end
return 1
"""
NEW, SEEN, CONFLICT = 1, 0, 2


def digest(body: bytes, ctype: str) -> str:
    """What makes two submissions the same request: the JSON's content (key order aside), or the bytes."""
    if ctype == "application/json":
        try:
            body = json.dumps(json.loads(body or b"{}"), sort_keys=True).encode()
        except ValueError:
            pass
    return hashlib.sha256(body).hexdigest()


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
    async def submit(self, kind: str, scope: str, seq: int, body: bytes, ctype: str,
                     refused: bytes | None = None, answered: bytes | None = None) -> tuple[str, int]:
        """Record a request under (scope, seq): pending, already failed with ``refused`` (its error's JSON), or
        already done with ``answered`` (its result's JSON: a request answered at submission).

        Returns (request_id, NEW | SEEN (a retry of the same body) | CONFLICT (another body at that seq))."""
        rid = request_id(scope, seq)
        fields: dict[str, Any] = {"kind": kind, "scope": scope, "seq": str(seq), "body": body, "ctype": ctype,
                                  "digest": digest(body, ctype), "at": str(time.time())}
        if refused is None and answered is None:
            fields["state"] = "pending"
        else:
            fields.update(state="failed" if answered is None else "done", result=refused or answered,
                          rctype="application/json", done_at=fields["at"])
        flat: list[Any] = [x for kv in fields.items() for x in kv]
        outcome = await self._submit(keys=[f"tk:req:{rid}", f"tk:ops:{scope}", "tk:pending"],
                                     args=[str(seq), rid, fields["digest"], fields["state"], *flat])
        return rid, int(outcome)

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

    async def session_requests(self, session_id: str) -> list[dict[str, bytes]]:
        """Every request recorded in a session's operation logs (its models', sampling sessions', losses')."""
        out = []
        async for key in self.redis.scan_iter(match=f"tk:ops:{session_id}:*", count=500):
            for rid in (await self.redis.hgetall(key)).values():
                if (req := await self.request(rid.decode())) is not None:
                    out.append(req)
        return out

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

    async def set_expiry(self, tinker_path: str, at: float | None) -> None:
        """A checkpoint's expiry (epoch seconds; None: kept for good), in ``tk:expiry``."""
        if at is None:
            await self.redis.hdel("tk:expiry", tinker_path)
        else:
            await self.redis.hset("tk:expiry", tinker_path, str(at))

    async def expiries(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in (await self.redis.hgetall("tk:expiry")).items()}

    async def set_public(self, tinker_path: str, public: bool) -> None:
        """A checkpoint published (listed ``public``) or not, in ``tk:public``."""
        if public:
            await self.redis.hset("tk:public", tinker_path, "1")
        else:
            await self.redis.hdel("tk:public", tinker_path)

    async def public(self) -> set[str]:
        return {k.decode() for k in await self.redis.hkeys("tk:public")}

    async def names(self, kind: str) -> list[str]:
        """The keys of every ``tk:{kind}:*`` record (a SCAN)."""
        prefix = f"tk:{kind}:"
        return sorted([k.decode()[len(prefix):] async for k in self.redis.scan_iter(match=prefix + "*", count=500)])

    async def count(self, name: str, n: int = 1) -> int:
        return int(await self.redis.hincrby("tk:telemetry", name, n))
