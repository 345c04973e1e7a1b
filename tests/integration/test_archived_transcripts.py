"""Archived transcripts through the API (issue 12; docs/architecture.md §6, §10): an episode whose transcript
left Redis for ``runs/<run>/transcripts.jsonl.gz`` and the coordinator's in-memory cache is still served by
``/v1/episodes/{id}`` and the dashboard's episode and tokens routes, found through the archive's index.

Episodes are played for real (the tiny model in-process against the env's scripted player) through the
coordinator's own ``_play``, which records and archives them in a real Redis; the routes are called over ASGI.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from services.common.bus import Bus
from services.contracts.config import parse_config
from services.contracts.players import Local, Scripted
from services.coordinator.api import create_app
from services.coordinator.archive import archive_find, archive_page, read_archive
from services.coordinator.scheduler import Coordinator
from services.envs.tictactoe import TicTacToe

AUTH = {"Authorization": "Bearer tok"}


def _coordinator(redis_url: str, model: Path, tmp_path: Path) -> Coordinator:
    cfg = parse_config({"run": {"name": "arch", "output_dir": str(tmp_path / "runs"), "transcripts_kept": 1},
                        "redis_url": redis_url, "api": {"token": "tok"},
                        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
                        "agents": {a: {"model_path": str(model), "sampling": {"max_new_tokens": 4}} for a in "AB"}})
    coord = Coordinator(cfg, Bus(redis_url, "arch", "coordinator"))
    coord.episode_log.archive.batch = 2  # spill every two episodes past the one kept
    return coord


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def _play(coord: Coordinator, model: Path, n: int, start: int = 0) -> list[str]:
    roles = {"X": Local(path=str(model), agent="A"), "O": Scripted(name="random")}
    ids = []
    for i in range(start, start + n):
        sampling = coord.players.sampling_for(roles)
        result = await coord.episode_log.play(TicTacToe({}, i), f"g{i}", roles, "train", sampling)
        assert result is not None
        ids.append(result.episode_id)
    return ids


async def test_an_archived_episode_is_served_with_its_tokens(redis_url: str, tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    coord = _coordinator(redis_url, tiny_model_dir, tmp_path)
    ids = await _play(coord, tiny_model_dir, 7)
    transport = httpx.ASGITransport(app=create_app(coord))
    async with httpx.AsyncClient(transport=transport, base_url="http://a", headers=AUTH) as client:
        live = {i: (await client.get(f"/v1/episodes/{i}")).json() for i in ids}
        tokens = {i: (await client.get(f"/v1/dashboard/episodes/{i}/tokens")).json() for i in ids}
        coord.episodes.clear()  # out of the in-memory cache: Redis, then the archive
        in_redis = {k.decode() for k in await coord.bus.redis.hkeys(coord.bus.streams.episodes())}
        archived = [r["id"] for r in read_archive(coord.episode_log.archive.path)]
        assert archived == ids[:len(archived)] and len(archived) >= 5 and not in_redis & set(archived)
        for i in ids:
            resp = await client.get(f"/v1/episodes/{i}")
            assert resp.status_code == 200, (i, resp.text)
            assert resp.json() == live[i]  # the same record, without the archived tokens
            assert (await client.get(f"/v1/dashboard/episodes/{i}/tokens")).json() == tokens[i]
            board = (await client.get(f"/v1/dashboard/episodes/{i}")).json()["board"]
            assert "ttt-board" in board["content"]
        for missing in ("nope", "a%09b", archived[0][:-1]):
            assert (await client.get(f"/v1/episodes/{missing}")).status_code == 404
            assert (await client.get(f"/v1/dashboard/episodes/{missing}/tokens")).status_code == 404
        assert (await client.get(f"/v1/episodes/{ids[0]}", headers={"Authorization": ""})).status_code == 401
        # the dashboard browses the archive, newest first, a page at a time
        route, newest = "/v1/dashboard/episodes", archived[::-1]
        first = (await client.get(route, params={"source": "archive", "limit": 3})).json()
        assert first["total"] == len(archived) and [e["id"] for e in first["episodes"]] == newest[:3]
        second = (await client.get(route, params={"source": "archive", "limit": 3, "offset": 3})).json()
        assert [e["id"] for e in second["episodes"]] == newest[3:6]
        assert (await client.get(route, params={"source": "archive", "purpose": "eval"})).json()["total"] == 0
    index = coord.episode_log.archive.index.read_text().splitlines()
    assert [line.split("\t")[0] for line in index] == archived
    await coord.bus.close()


async def test_an_older_archive_is_indexed_and_a_torn_tail_is_survived(redis_url: str, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    coord = _coordinator(redis_url, tiny_model_dir, tmp_path)
    ids = await _play(coord, tiny_model_dir, 5)
    archived = [r["id"] for r in read_archive(coord.episode_log.archive.path)]
    coord.episode_log.archive.index.unlink()  # an archive written before the index existed
    path, index = coord.episode_log.archive.path, coord.episode_log.archive.index
    total, page = archive_page(path, index, lambda r: True, 0, 100)  # read only (a finished run's view)
    assert total == len(archived) and [r["id"] for r in page] == archived[::-1]
    assert (archive_find(path, index, archived[-1]) or {}).get("id") == archived[-1] and not index.exists()
    first = coord.episode_log.archive.find(archived[0])
    assert first is not None and first["id"] == archived[0] and "reply_tokens" in first
    assert coord.episode_log.archive.find("a\t0\t1") is None and coord.episode_log.archive.find("") is None
    assert [line.split("\t")[0] for line in coord.episode_log.archive.index.read_text().splitlines()] == archived
    _append(coord.episode_log.archive.index, archived[0].encode() + b"\t12")  # a crash while indexing left a torn line
    _append(coord.episode_log.archive.path, b"\x1f\x8b\x08\x00garbage")  # and one while appending, a torn member
    more = await _play(coord, tiny_model_dir, 4, start=5)
    coord.episodes.clear()
    now: list[str] = []  # read_archive stops at the torn member; find goes through the index past it
    for i in ids + more:
        if await coord.bus.redis.hexists(coord.bus.streams.episodes(), i):
            continue
        rec = coord.episode_log.archive.find(i)
        assert rec is not None and rec["id"] == i, i
        now.append(i)
    assert set(now) >= set(archived) and len(now) > len(archived)  # the new spills were indexed too
    await coord.bus.close()
