"""LoRA adapters on the embedded engine over HTTP: SGLang's /load_lora_adapter, /unload_lora_adapter and a
per-request ``lora_path``; two agents' adapters on one engine stay isolated."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI

from services.common.adapter_dir import base_of, is_adapter_dir
from services.contracts.config import AgentConfig, AlgorithmConfig, LoraConfig
from services.contracts.messages import Sample
from services.engine import server
from services.inference.generator import Engine, GenRequest
from services.training.backends import make_policy
from services.training.torch_backend import TorchPolicy
from tests.helpers import ADMIN, ADMIN_TOKEN, completion_sample

LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
PROMPT = [5, 6, 7, 8]


def batch(flip: bool = False) -> list[Sample]:
    return [completion_sample([5, 6, 7], out, 1.0 - r if flip else r, "g", logp=-5.5)
            for out, r in (([40, 41, 42], 1.0), ([50, 51, 52], 0.0))]


def trained(model_dir: Path, seed: int, flip: bool = False) -> TorchPolicy:
    p = make_policy(AgentConfig(model_path=str(model_dir), lora=LORA, seed=seed,
                                algorithm=AlgorithmConfig(lr=0.05)), 1.0)
    p.train_step(batch(flip))
    return p


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Agent A's versions 1 and 2 and agent B's version 1, as the trainer publishes them."""
    root = tmp_path_factory.mktemp("adapters")
    a, b = trained(tiny_model_dir, 1), trained(tiny_model_dir, 2, flip=True)
    out = {"A1": a.save(root / "A" / "v00001")[0], "B1": b.save(root / "B" / "v00001")[0]}
    a.train_step(batch())
    out["A2"] = a.save(root / "A" / "v00002")[0]
    return out


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path) -> Iterator[FastAPI]:
    app = server.create_app(tiny_model_dir, engine_id="lora", admin_token=ADMIN_TOKEN)
    try:
        yield app
    finally:
        app.state.engine.stop()


@pytest.fixture
async def http(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine",
                                 headers=ADMIN) as client:
        yield client


async def greedy(http: httpx.AsyncClient, lora: Any = None, prompt: Any = PROMPT) -> Any:
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                             "ignore_eos": True}}
    resp = await http.post("/generate", json=body | ({"lora_path": lora} if lora is not None else {}))
    assert resp.status_code == 200, resp.text
    return resp.json()


def tokens(reply: dict[str, Any]) -> tuple[list[int], list[float]]:
    return reply["output_ids"], [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]


async def on_merged(path: Path) -> tuple[list[int], list[float]]:
    """The same greedy turn on an engine built on the adapter directory (the adapter merged into the base)."""
    engine = Engine(path)
    try:
        r = await engine.generate(GenRequest(rid="m", input_ids=PROMPT, temperature=0.0, max_new_tokens=4,
                                             ignore_eos=True))
    finally:
        engine.stop()
    return r.output_ids, r.logprobs


def test_the_trainer_publishes_the_adapter_alone(adapters: dict[str, Path], tiny_model_dir: Path) -> None:
    d = adapters["A1"]
    assert sorted(p.name for p in d.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert is_adapter_dir(d) and base_of(d) == str(tiny_model_dir.resolve())
    assert sum(p.stat().st_size for p in d.iterdir()) < 0.2 * (tiny_model_dir / "model.safetensors").stat().st_size


async def test_load_generate_per_request_and_unload(http: httpx.AsyncClient, adapters: dict[str, Path]) -> None:
    base = tokens(await greedy(http))
    resp = await http.post("/load_lora_adapter", json={"lora_name": "A-v1", "lora_path": str(adapters["A1"])})
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert resp.json()["loaded_adapters"] == {"A-v1": str(adapters["A1"])}
    ids, lps = tokens(await greedy(http, "A-v1"))
    want_ids, want_lps = await on_merged(adapters["A1"])
    assert ids == want_ids
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4, rtol=0)
    assert lps != base[1]
    # one batch mixing the adapter and the bare base: each prompt as if alone
    mixed = await greedy(http, ["A-v1", None], [PROMPT, PROMPT])
    assert tokens(mixed[0])[0] == ids
    torch.testing.assert_close(torch.tensor(tokens(mixed[0])[1]), torch.tensor(lps), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(tokens(mixed[1])[1]), torch.tensor(base[1]), atol=1e-5, rtol=0)
    resp = await http.post("/unload_lora_adapter", json={"lora_name": "A-v1"})
    assert resp.status_code == 200 and resp.json()["loaded_adapters"] == {}
    gone = await http.post("/generate", json={"input_ids": PROMPT, "lora_path": "A-v1"})
    assert gone.status_code == 400 and "not a loaded adapter" in gone.json()["error"]["message"]
    assert (await http.post("/unload_lora_adapter", json={"lora_name": "A-v1"})).status_code == 400


async def test_bad_adapters_and_callers_are_refused(http: httpx.AsyncClient, app: FastAPI, adapters: dict[str, Path],
                                                    tiny_model_dir: Path, tmp_path: Path) -> None:
    body = {"lora_name": "x", "lora_path": str(adapters["B1"])}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as anon:
        assert (await anon.post("/load_lora_adapter", json=body)).status_code == 401
        assert (await anon.post("/unload_lora_adapter", json={"lora_name": "x"})).status_code == 401
    for path, needle in ((tiny_model_dir, "adapter_config.json"), (tmp_path / "none", "adapter_config.json")):
        resp = await http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
        assert resp.status_code == 400 and needle in resp.json()["error_message"], resp.text
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "adapter_config.json").write_text((adapters["B1"] / "adapter_config.json").read_text())
    from safetensors.torch import load_file, save_file

    state = {k: torch.zeros(v.shape[0], v.shape[1] + 1) for k, v in load_file(adapters["B1"] /
                                                                            "adapter_model.safetensors").items()}
    save_file(state, str(wrong / "adapter_model.safetensors"))
    resp = await http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(wrong)})
    assert resp.status_code == 400 and "do not fit" in resp.json()["error_message"]
    assert app.state.engine.adapters.names() == []
    assert (await http.post("/load_lora_adapter", json={"lora_name": "", "lora_path": "x"})).status_code == 400


async def test_two_agents_on_one_engine_stay_isolated(http: httpx.AsyncClient, adapters: dict[str, Path]) -> None:
    for name, key in (("A-v1", "A1"), ("B-v1", "B1")):
        resp = await http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters[key])})
        assert resp.status_code == 200, resp.text
    b_before = tokens(await greedy(http, "B-v1"))
    a_before = tokens(await greedy(http, "A-v1"))
    # A trains on: its version 2 replaces version 1 on the shared engine; B's replies do not move
    assert (await http.post("/load_lora_adapter", json={"lora_name": "A-v2",
                                                        "lora_path": str(adapters["A2"])})).status_code == 200
    assert (await http.post("/unload_lora_adapter", json={"lora_name": "A-v1"})).status_code == 200
    a_after = tokens(await greedy(http, "A-v2"))
    assert a_after[1] != a_before[1]
    assert tokens(await greedy(http, "B-v1")) == b_before
    mixed = await greedy(http, ["A-v2", "B-v1", None], [PROMPT] * 3)
    torch.testing.assert_close(torch.tensor(tokens(mixed[1])[1]), torch.tensor(b_before[1]), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(tokens(mixed[0])[1]), torch.tensor(a_after[1]), atol=1e-5, rtol=0)
    for name in ("A-v2", "B-v1"):
        assert (await http.post("/unload_lora_adapter", json={"lora_name": name})).status_code == 200


async def test_an_agents_engine_loads_only_adapters_its_trainer_signed(adapters: dict[str, Path],
                                                                       tiny_model_dir: Path) -> None:
    """The admin token alone loads no adapter on an engine bound to agent A: the name must be ``A-v<version>``
    and the trainer's signature and checksum must match the files (403, nothing loaded); a signed one loads."""
    from services.common.weights_auth import run_secret
    from tests.helpers import signed_proof

    signed_app = server.create_app(tiny_model_dir, engine_id="signed", admin_token=ADMIN_TOKEN,
                                   weights_secret=run_secret(), agent="A")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=signed_app), base_url="http://engine",
                                     headers=ADMIN) as client:
            async def load(name: str, path: Path, headers: dict[str, str]) -> httpx.Response:
                return await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                                          headers=headers)

            bare = await load("A-v1", adapters["A1"], {})
            assert bare.status_code == 403 and "no weights signature" in bare.json()["error_message"]
            foreign = await load("B-v1", adapters["B1"], signed_proof(adapters["B1"], "B", 1).headers())
            assert foreign.status_code == 403 and "serves agent 'A'" in foreign.json()["error_message"]
            replayed = await load("A-v2", adapters["A1"], signed_proof(adapters["A1"], "A", 1).headers())
            assert replayed.status_code == 403 and "bad signature" in replayed.json()["error_message"]
            assert replayed.json()["loaded_adapters"] == {}
            ok = await load("A-v1", adapters["A1"], signed_proof(adapters["A1"], "A", 1).headers())
            assert ok.status_code == 200 and ok.json()["loaded_adapters"] == {"A-v1": str(adapters["A1"])}, ok.text
    finally:
        signed_app.state.engine.stop()
