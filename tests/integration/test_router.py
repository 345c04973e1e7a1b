"""Two embedded engines behind the real SGLang router (sglang-router), all real processes.

Round-robin over both engines, SGLang reply parsing through ``EngineClient``,
weight updates per engine, and removing / adding a worker at run time; the run's admin token
guards the engines' admin routes and the router's worker admin and data plane.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.common.sglang_router import add_worker, list_workers, remove_worker
from services.rollout.engine_client import EngineClient, EngineClientError
from tests.helpers import ADMIN_TOKEN, engines_behind_router


@dataclass
class Cluster:
    router_url: str
    engine_urls: list[str]
    model_dir: Path


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("router-logs")
    with engines_behind_router(tiny_model_dir, logs, ["engine-0", "engine-1"], "--max-batch", "16") as (url, urls):
        yield Cluster(url, urls, tiny_model_dir)


async def _burst(client: EngineClient, n: int, tag: str) -> list[str | None]:
    results = await asyncio.gather(*(
        client.generate([5 + i, 6, 7], {"max_new_tokens": 4, "temperature": 0.8, "sampling_seed": i},
                        f"{tag}-{i}")
        for i in range(n)))
    for i, r in enumerate(results):
        assert r.rid == f"{tag}-{i}" and r.prompt_tokens == 3
        assert len(r.output_ids) == len(r.output_logprobs) and 0 < len(r.output_ids) <= 4
        assert r.finish_reason in ("stop", "length") and all(lp <= 0 for lp in r.output_logprobs)
    return [r.engine for r in results]


async def test_round_robin_and_worker_admin(cluster: Cluster) -> None:
    e0, e1 = cluster.engine_urls
    async with EngineClient(cluster.router_url, timeout=30.0, token=ADMIN_TOKEN) as client:
        served = Counter(await _burst(client, 8, "rr"))
        assert set(served) == {"engine-0", "engine-1"}, served
        assert min(served.values()) >= 2, served  # round robin spreads them

        await remove_worker(cluster.router_url, e1, token=ADMIN_TOKEN)
        assert await list_workers(cluster.router_url, token=ADMIN_TOKEN) == [e0]
        assert set(await _burst(client, 4, "only0")) == {"engine-0"}

        await add_worker(cluster.router_url, e1, token=ADMIN_TOKEN)
        assert sorted(await list_workers(cluster.router_url, token=ADMIN_TOKEN)) == sorted([e0, e1])
        assert set(await _burst(client, 8, "back")) == {"engine-0", "engine-1"}


async def _weight_version(engine_url: str) -> int:
    """The engine's weight version, from ``/get_model_info`` (SGLang serves no ``/get_weight_version``)."""
    async with httpx.AsyncClient(timeout=30.0, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        resp = await http.get(f"{engine_url.rstrip('/')}/get_model_info")
    resp.raise_for_status()
    return int(resp.json()["weight_version"])


async def test_weight_update_through_client(cluster: Cluster) -> None:
    async with EngineClient(cluster.router_url, timeout=30.0, token=ADMIN_TOKEN) as client:
        for url in cluster.engine_urls:
            await client.update_weights(url, str(cluster.model_dir), 3)
            assert await _weight_version(url) == 3
        result = await client.generate([9, 9, 9], {"max_new_tokens": 2, "temperature": 0}, "after-update")
        assert result.weight_version == 3
        with pytest.raises(EngineClientError, match="not loaded"):
            await client.update_weights(cluster.engine_urls[0], str(cluster.model_dir / "nope"), 4)
        assert await _weight_version(cluster.engine_urls[0]) == 3
        with pytest.raises(EngineClientError, match="400"):
            await client.generate([10**6], {"max_new_tokens": 2}, "bad-token")


async def test_admin_routes_need_the_runs_token(cluster: Cluster) -> None:
    """Without the token (or with another): the engines' admin routes and the router's worker admin and
    data plane answer 401, and a probe learns nothing of the disk; health and info stay open."""
    e0 = cluster.engine_urls[0]
    for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": ADMIN_TOKEN}):
        async with httpx.AsyncClient(timeout=10.0, headers=headers) as http:
            probe = await http.post(f"{e0}/update_weights_from_disk", json={"model_path": "/etc"})
            assert probe.status_code == 401 and "/etc" not in probe.text, probe.text
            for path in ("/pause_generation", "/continue_generation", "/flush_cache"):
                assert (await http.post(f"{e0}{path}")).status_code == 401, path
            assert (await http.post(f"{e0}/abort_request", json={"abort_all": True})).status_code == 401
            assert (await http.get(f"{cluster.router_url}/workers")).status_code == 401
            forged = await http.post(f"{cluster.router_url}/workers", json={"url": "http://127.0.0.1:9"})
            assert forged.status_code == 401
            gen = await http.post(f"{cluster.router_url}/generate", json={"input_ids": [5], "sampling_params": {}})
            assert gen.status_code == 401
            assert (await http.get(f"{e0}/get_model_info")).status_code == 200
            assert (await http.get(f"{cluster.router_url}/health")).status_code == 200
    assert sorted(await list_workers(cluster.router_url, token=ADMIN_TOKEN)) == sorted(cluster.engine_urls)
