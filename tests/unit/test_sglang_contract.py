"""Our SGLang contract against SGLang's own source (the ``sglang`` wheel, installed ``--no-deps``).

Written against sglang==0.5.23 (pinned in the Makefile and constraints.txt). SGLang's modules
need GPU-side dependencies to import, so the test parses them with ``ast``: the request structs in
``managers/io_struct.py``, the sampling params, the finish reasons' ``to_json``, the ``meta_info``
keys ``tokenizer_manager`` writes, the weight-version spans and the HTTP routes of
``entrypoints/http_server.py``. The requests are the ones the rollout's ``EngineClient`` really
sends (captured on the wire), the replies the ones the embedded engine really gives.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import importlib.util
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.contracts import sglang_api as api
from services.contracts.messages import SamplingParams
from services.engine import server
from services.rollout.engine_client import EngineClient
from tests.helpers import ADMIN, ADMIN_TOKEN

PINNED = "0.5.23"


@pytest.fixture(scope="module")
def sgl() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, (
        f"the sglang wheel is not installed: pip install --no-deps sglang=={PINNED} (make install does it)")
    assert importlib.metadata.version("sglang") == PINNED
    return Path(next(iter(spec.submodule_search_locations))) / "srt"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _fields(tree: ast.Module, name: str) -> set[str]:
    """Annotated attributes of a class and of its bases defined in the same module."""
    cls = _class(tree, name)
    own = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for base in cls.bases:
        if isinstance(base, ast.Name) and any(isinstance(n, ast.ClassDef) and n.name == base.id
                                              for n in tree.body):
            own |= _fields(tree, base.id)
    return own


def _literal_values(tree: ast.Module, cls: str, attr: str) -> set[str]:
    node = next(n for n in _class(tree, cls).body if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name) and n.target.id == attr)
    return {c.value for c in ast.walk(node.annotation) if isinstance(c, ast.Constant) and isinstance(c.value, str)}


def _to_json_keys(tree: ast.Module) -> dict[str, tuple[str, set[str]]]:
    """FINISH_* class -> (its "type", the keys its to_json() returns)."""
    out = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("FINISH")):
        fn = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "to_json")
        d = next(n for n in ast.walk(fn) if isinstance(n, ast.Dict))
        keys = {k.value for k in d.keys if isinstance(k, ast.Constant)}
        kind = next(v.value for k, v in zip(d.keys, d.values, strict=True)
                    if isinstance(k, ast.Constant) and k.value == "type")
        out[cls.name] = (kind, keys)
    return out


def _meta_info_keys(*trees: ast.Module) -> set[str]:
    """Every key SGLang writes into a dict named meta_info (literal, subscript or .update)."""
    keys: set[str] = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "meta_info"
                                                 for t in n.targets) and isinstance(n.value, ast.Dict):
                keys |= {k.value for k in n.value.keys if isinstance(k, ast.Constant)}
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "meta_info" \
                    and isinstance(n.slice, ast.Constant) and isinstance(n.ctx, ast.Store):
                keys.add(n.slice.value)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update" \
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == "meta_info":
                for arg in n.args:
                    if isinstance(arg, ast.Dict):
                        keys |= {k.value for k in arg.keys if isinstance(k, ast.Constant)}
    return keys


def _routes(tree: ast.Module) -> set[str]:
    routes = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in (
                "get", "post", "put", "api_route") and isinstance(n.func.value, ast.Name) \
                and n.func.value.id == "app" and n.args and isinstance(n.args[0], ast.Constant):
            routes.add(n.args[0].value)
    return routes


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path) -> Iterator[FastAPI]:
    app = server.create_app(tiny_model_dir, engine_id="contract", admin_token=ADMIN_TOKEN)
    try:
        yield app
    finally:
        app.state.engine.stop()


class _Recorder(httpx.ASGITransport):
    """The embedded engine in process, recording every JSON body sent to it."""

    def __init__(self, app: FastAPI) -> None:
        super().__init__(app=app)
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.content:
            self.sent.append((request.url.path, json.loads(request.content)))
        return await super().handle_async_request(request)


@pytest.fixture
async def wire(app: FastAPI) -> AsyncIterator[tuple[EngineClient, _Recorder]]:
    rec = _Recorder(app)
    async with EngineClient("http://engine", timeout=60.0, transport=rec, token=ADMIN_TOKEN) as client:
        yield client, rec


def test_request_models_are_sglang_fields(sgl: Path) -> None:
    io = _tree(sgl / "managers" / "io_struct.py")
    sp = _tree(sgl / "sampling" / "sampling_params.py")
    assert set(api.GenerateReqInput.model_fields) <= _fields(io, "GenerateReqInput")
    assert set(server._ROUTER_FIELDS) - {"model"} <= _fields(io, "GenerateReqInput")  # "model": router-only
    assert set(api.GenerateSamplingParams.model_fields) <= _fields(sp, "SamplingParams")
    rollout_sampling = {"sampling_seed" if f == "seed" else f for f in SamplingParams.model_fields}
    assert rollout_sampling <= _fields(sp, "SamplingParams")
    assert set(api.UpdateWeightFromDiskReqInput.model_fields) <= _fields(io, "UpdateWeightFromDiskReqInput")
    assert set(api.UpdateWeightFromDiskReqOutput.model_fields) == _fields(io, "UpdateWeightFromDiskReqOutput") - {
        "rid", "http_worker_ipc"}
    assert set(api.AbortReqInput.model_fields) <= _fields(io, "AbortReq")
    assert set(api.PauseGenerationReqInput.model_fields) <= _fields(io, "PauseGenerationReqInput")
    assert _literal_values(io, "PauseGenerationReqInput", "mode") == {"abort", "retract", "in_place"}
    assert set(api.ContinueGenerationReqInput.model_fields) <= _fields(io, "ContinueGenerationReqInput")
    assert set(api.LoadLoRAAdapterReqInput.model_fields) <= _fields(io, "LoadLoRAAdapterReqInput")
    assert set(api.UnloadLoRAAdapterReqInput.model_fields) <= _fields(io, "UnloadLoRAAdapterReqInput")
    assert set(api.LoRAUpdateOutput.model_fields) <= _fields(io, "LoRAUpdateOutput")
    assert "lora_path" in api.GenerateReqInput.model_fields


def test_lora_engine_flags_are_sglang_server_args(sgl: Path) -> None:
    """The flags an SGLang engine of a LoRA agent is started with (commands.py) are SGLang server args."""
    from services.contracts.config import AgentConfig, LoraConfig
    from services.rollout.commands import engine_command

    order = (sgl / "arg_groups" / "field_order.py").read_text()
    cmd = engine_command(AgentConfig(model_path="m", engine="sglang", lora=LoraConfig()), "A", 0, 30000)
    flags = [a for a in cmd if a.startswith("--enable-lora") or a.startswith("--max-lora") or a.startswith("--lora")]
    assert flags == ["--enable-lora", "--max-lora-rank", "--lora-target-modules"]
    for flag in flags:
        assert f'"{flag[2:].replace("-", "_")}"' in order, flag


def test_engine_serves_sglang_routes(sgl: Path, app: FastAPI) -> None:
    theirs = _routes(_tree(sgl / "entrypoints" / "http_server.py"))
    design = {"/health", "/health_generate", "/get_model_info", "/get_server_info", "/generate",
              "/update_weights_from_disk", "/load_lora_adapter", "/unload_lora_adapter", "/get_weight_version",
              "/flush_cache", "/pause_generation",
              "/continue_generation", "/abort_request", "/model_info", "/server_info"}
    ours = {getattr(r, "path", "") for r in app.routes}
    assert design <= ours, design - ours
    # SGLang 0.5.23 has no /get_weight_version (docs/architecture.md §5 names it): the version is in /get_model_info,
    # so a client that reads it there works against both.
    assert design - theirs == {"/get_weight_version"}


async def test_rollout_requests_and_engine_replies_match_sglang(sgl: Path, app: FastAPI, tiny_model_dir: Path,
                                                               wire: tuple[EngineClient, _Recorder]) -> None:
    client, rec = wire
    io = _tree(sgl / "managers" / "io_struct.py")
    sp_fields = _fields(_tree(sgl / "sampling" / "sampling_params.py"), "SamplingParams")
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=5, stop_token_ids=[3], seed=4)
    # exactly how the rollout maps its SamplingParams onto SGLang's (services/rollout/__main__.py)
    mapped = sampling.model_dump(exclude={"seed"}) | {"sampling_seed": sampling.seed}
    result = await client.generate([5, 6, 7], mapped, rid="c-1")
    await client.update_weights("http://engine", str(tiny_model_dir), 0)
    gen_body = next(b for path, b in rec.sent if path == "/generate")
    upd_body = next(b for path, b in rec.sent if path == "/update_weights_from_disk")
    assert set(gen_body) <= _fields(io, "GenerateReqInput")
    assert set(gen_body["sampling_params"]) <= sp_fields
    assert set(upd_body) <= _fields(io, "UpdateWeightFromDiskReqInput")
    assert result.weight_versions == ((0, 0, len(result.output_ids)),)

    finish = _to_json_keys(_tree(sgl / "managers" / "schedule_batch.py"))
    meta_keys = _meta_info_keys(_tree(sgl / "managers" / "tokenizer_manager.py"),
                                _tree(sgl / "utils" / "weight_versions.py"))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine", headers=ADMIN)
    async with http:
        replies = [(await http.post("/generate", json=body)).json() for body in (
            {"input_ids": [5, 6], "return_logprob": True, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
            {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "stop_token_ids": list(
                range(app.state.engine.vocab_size))}},
        )]
        pause = (await http.post("/pause_generation", json={"mode": "in_place"})).json()
        assert pause["status"] == "ok"
        task = asyncio.create_task(http.post("/generate", json={"input_ids": [9], "rid": "to-abort"}))
        for _ in range(200):
            if app.state.engine.load()["num_reqs"]:
                break
            await asyncio.sleep(0.01)
        assert (await http.post("/abort_request", json={"rid": "to-abort"})).status_code == 200
        replies.append((await task).json())
        await http.post("/continue_generation")
    kinds = {"length": "FINISH_LENGTH", "stop": "FINISH_MATCHED_TOKEN", "abort": "FINISH_ABORT"}
    assert [r["meta_info"]["finish_reason"]["type"] for r in replies] == ["length", "stop", "abort"]
    for r in replies:
        fr = r["meta_info"]["finish_reason"]
        kind, keys = finish[kinds[fr["type"]]]
        assert fr["type"] == kind and set(fr) == keys, (fr, keys)
        assert set(r) == {"text", "output_ids", "meta_info"}
        assert set(r["meta_info"]) - {"engine", "e2e_latency"} <= meta_keys, set(r["meta_info"]) - meta_keys
        assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version"} <= set(r["meta_info"])
        for span in r["meta_info"]["weight_versions"]:
            assert set(span) == {"version", "start", "end"}
    # output_token_logprobs: SGLang's (logprob, token_id, text-or-None) triples
    src = (sgl / "managers" / "tokenizer_manager.py").read_text()
    assert "(logprob, token_id, None)" in src
    lp = replies[0]["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lp] == replies[0]["output_ids"] and all(x is None for _, _, x in lp)


async def test_bad_requests_are_sglang_400s(app: FastAPI) -> None:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine", headers=ADMIN)
    async with http:
        for body, needle in (({"input_ids": [1], "nope": 1}, "nope"), ({"input_ids": []}, "empty"),
                             ({"text": ""}, "empty"),
                             ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
                             ({"input_ids": [1], "sampling_params": {"bogus_param": 1}}, "bogus_param")):
            resp = await http.post("/generate", json=body)
            assert resp.status_code == 400, resp.text
            assert needle in resp.json()["error"]["message"]
        assert (await http.post("/pause_generation", json={"mode": "sideways"})).status_code == 400
        assert (await http.get("/health")).status_code == 200
