"""SGLang's ``/generate`` for the embedded engine: request bodies in, reply bodies out, kept cheap.

``parse_generate`` reads a body with orjson, checks the fields SGLang's router adds, validates each
item with the contract's ``GenerateReqInput`` (so a bad field gets a 400 naming it) and turns it into
the engine's ``GenRequest`` samples. A batch, as SGLang's batch ``/generate``: ``input_ids`` a list of
lists (or ``text`` a list of strings), with ``sampling_params``, ``rid`` and ``return_logprob`` either
shared or one per prompt (a shared ``rid`` becomes ``{rid}_{i}``, as SGLang); its reply is a list,
each prompt's ``n`` samples in a row. ``reply`` builds SGLang's reply object directly (the shape
``GenerateReqOutput`` describes, ``None`` fields left out except in ``finish_reason``, which is SGLang's
``to_json()`` with every key), and ``json_response`` serialises it with orjson: no per-reply pydantic
validation on the hot path.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from services.contracts.sglang_api import GenerateReqInput
from services.inference.generator import Engine
from services.inference.request import EngineError, GenRequest

# Fields SGLang's router adds to /generate bodies: name -> values we can honour (None: any value).
ROUTER_FIELDS: dict[str, tuple[Any, ...] | None] = {
    "model": None, "log_metrics": None, "no_logs": None, "return_text_in_logprobs": None,
    "return_hidden_states": (False,), "background": (False,), "return_bytes": (False,),
    "return_entropy": (False,), "logprob_start_len": None, "top_logprobs_num": (None, 0),
    "custom_labels": None,
}
_PER_PROMPT = ("sampling_params", "rid", "return_logprob", "lora_path")
# Request ids when the caller gives none: unique per process, without a urandom syscall per request
# (a syscall on the event loop gives the GIL to the model thread, and getting it back waits).
_RID_PREFIX = uuid.uuid4().hex[:16]
_RID_COUNTER = itertools.count()


@dataclass
class GenerateCall:
    """One ``/generate`` call: its samples (per prompt, ``n`` each) and how to answer."""

    items: list[tuple[GenerateReqInput, list[GenRequest]]]
    batch: bool
    text_in_logprobs: bool
    start: float = field(default_factory=time.perf_counter)

    @property
    def requests(self) -> list[GenRequest]:
        return [r for _, reqs in self.items for r in reqs]


def validation_message(exc: Any) -> str:
    """A pydantic / FastAPI validation error as one line naming each field."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise EngineError("body must be a JSON object")
    return body


def validate(model: type[BaseModel], body: dict[str, Any], where: str = "") -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise EngineError(where + validation_message(exc)) from None


def parse_generate(raw: bytes, engine: Engine) -> GenerateCall:
    body = load_json(raw)
    extras = {name: body.pop(name) for name in ROUTER_FIELDS if name in body}
    for name, value in extras.items():
        allowed = ROUTER_FIELDS[name]
        if allowed is not None and value not in allowed:
            raise EngineError(f"{name}={value!r} is not supported by the embedded engine")
    prompts = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
    batch = isinstance(body.get("text"), list) or (
        isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], list))
    bodies = _split_batch(body, prompts) if batch else [body]
    items = []
    for i, item in enumerate(bodies):
        req_in: GenerateReqInput = validate(GenerateReqInput, item, f"item {i}: " if batch else "")
        items.append((req_in, _samples(req_in, engine)))
    return GenerateCall(items, batch, bool(extras.get("return_text_in_logprobs", False)))


def _split_batch(body: dict[str, Any], prompts: Any) -> list[dict[str, Any]]:
    """A batch body -> one body per prompt (SGLang's normalisation of shared and per-prompt fields)."""
    if not isinstance(prompts, list) or not prompts:
        raise EngineError("a batch needs a non-empty list of prompts")
    key = "input_ids" if body.get("input_ids") is not None else "text"
    n = len(prompts)
    for name in _PER_PROMPT:
        if isinstance(body.get(name), list) and len(body[name]) != n:
            raise EngineError(f"{name} has {len(body[name])} entries for a batch of {n} prompts")
    out = []
    for i, prompt in enumerate(prompts):
        item = {**body, key: prompt}
        for name in _PER_PROMPT:
            if isinstance(body.get(name), list):
                item[name] = body[name][i]
        if isinstance(body.get("rid"), str):
            item["rid"] = f"{body['rid']}_{i}"
        out.append(item)
    return out


def _samples(req_in: GenerateReqInput, engine: Engine) -> list[GenRequest]:
    """The request's ``n`` samples (ids ``{rid}-{i}`` when n > 1; seeds ``sampling_seed + i``)."""
    sp = req_in.sampling_params
    ids = req_in.input_ids
    if ids is None:
        ids = list(engine.tokenizer(req_in.text)["input_ids"])
        if not ids:
            raise EngineError("text tokenizes to no tokens")
    stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    rid = req_in.rid or f"{_RID_PREFIX}{next(_RID_COUNTER):016x}"
    return [GenRequest(rid=rid if sp.n == 1 else f"{rid}-{i}", input_ids=ids, temperature=sp.temperature,
                       top_p=sp.top_p, top_k=sp.top_k, max_new_tokens=sp.max_new_tokens,
                       stop_token_ids=frozenset(sp.stop_token_ids or ()), stop_strings=stop,
                       seed=None if sp.sampling_seed is None else sp.sampling_seed + i, ignore_eos=sp.ignore_eos,
                       lora=req_in.lora_path)
            for i in range(sp.n)]


def reply(req: GenRequest, req_in: GenerateReqInput, call: GenerateCall, engine: Engine,
          engine_id: str | None) -> dict[str, Any]:
    """SGLang's reply object for one finished sample."""
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": req.finish, "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids), "weight_version": str(req.weight_version),
        "weight_versions": req.weight_version_spans(), "cached_tokens": 0,
    }
    if req_in.return_logprob:
        decode = engine.tokenizer.decode
        meta["output_token_logprobs"] = [[lp, t, decode([t]) if call.text_in_logprobs else None]
                                         for lp, t in zip(req.logprobs, req.output_ids, strict=True)]
    meta["e2e_latency"] = time.perf_counter() - call.start
    if engine_id is not None:
        meta["engine"] = engine_id
    text = engine.tokenizer.decode(req.output_ids, skip_special_tokens=True)
    matched = (req.finish or {}).get("matched")
    if isinstance(matched, str) and matched in text:  # as SGLang (no_stop_trim false): text ends before it
        text = text[:text.index(matched)]
    return {"text": text, "output_ids": req.output_ids, "meta_info": meta}


def replies(call: GenerateCall, engine: Engine, engine_id: str | None) -> Any:
    """The whole call's reply: one object, or a list (n > 1, or a batch)."""
    outs = [reply(r, req_in, call, engine, engine_id) for req_in, reqs in call.items for r in reqs]
    return outs if call.batch or len(outs) > 1 else outs[0]


def json_response(content: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status_code, media_type="application/json")
