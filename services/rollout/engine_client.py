"""Async client the rollout service uses to talk to an agent's inference engines.

Generation goes through the agent's SGLang router (``POST {router}/generate``, with ``lora_path`` naming
the adapter to generate under when the agent trains LoRA); weight updates go to each engine directly
(``/update_weights_from_disk``, or ``/load_lora_adapter`` and ``/unload_lora_adapter`` for an adapter),
since the router does not fan them out. The same client drives SGLang on GPU and
the embedded engine on CPU: replies are parsed with the SGLang contract models.

With the run's admin token (``token``: services/common/admin_token.py) every call carries it as a bearer
token: the engines' admin routes and the router (its ``--api-key``) require it (docs/architecture.md §2.3).
Given the engines' URLs (``engines``), a generate call that times out has its requests aborted on every engine
(``/abort_request`` per rid, best effort) before its error is raised, so the caller's retry does not run beside them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import orjson
from pydantic import ValidationError

from services.common.admin_token import bearer
from services.common.latency import LatencyWindow
from services.common.weights_auth import WeightsProof
from services.contracts.messages import FinishReason
from services.contracts.sglang_api import (
    GenerateReqOutput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
)

log = logging.getLogger("tandem.rollout")
ABORT_WAIT_S = 5.0  # an engine's answer to ``/abort_request``: it only marks requests, so this is ample


class EngineClientError(RuntimeError):
    """The router or an engine refused a request or answered something unparseable."""

    def __init__(self, message: str, status: int | None = None, loaded: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status when the engine answered with an error
        self.loaded = loaded or {}  # an adapter route's answer: the adapters the engine holds

    @property
    def request_rejected(self) -> bool:
        """A 4xx: the request itself is bad, and retrying it cannot help."""
        return self.status is not None and 400 <= self.status < 500


@dataclass(frozen=True)
class GenerateResult:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int  # the OLDEST version that produced a token (what staleness must count)
    prompt_tokens: int
    engine: str | None = None  # meta_info.engine when the engine reports it (ours does, SGLang does not)
    rid: str | None = None
    finish_message: str | None = None
    weight_versions: tuple[tuple[int, int, int], ...] = ()  # (version, start, end) spans, SGLang's meta_info


def _version(raw: str) -> int:
    """SGLang reports weight_version as a string; its initial value "default" counts as 0."""
    try:
        return int(raw)
    except ValueError:
        return 0


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body.get("detail") or body)
    return str(body)[:500]


def _result(body: Any, rid: str) -> GenerateResult:
    """One SGLang reply object as a ``GenerateResult`` (validated by the contract's ``GenerateReqOutput``)."""
    try:
        out = GenerateReqOutput.model_validate(body)
    except (ValueError, ValidationError) as exc:
        raise EngineClientError(f"generate {rid}: unparseable reply: {exc}") from exc
    meta = out.meta_info
    logprobs = [float(lp) for lp, _, _ in (meta.output_token_logprobs or [])]
    if len(logprobs) != len(out.output_ids):
        raise EngineClientError(f"generate {rid}: {len(logprobs)} logprobs, {len(out.output_ids)} tokens")
    engine = (meta.model_extra or {}).get("engine")
    spans = tuple((_version(s.version), s.start, s.end) for s in meta.weight_versions or [])
    oldest = min((v for v, start, end in spans if end > start), default=_version(meta.weight_version))
    return GenerateResult(
        output_ids=list(out.output_ids), output_logprobs=logprobs, finish_reason=meta.finish_reason.type,
        weight_version=oldest, prompt_tokens=meta.prompt_tokens, weight_versions=spans,
        engine=str(engine) if engine is not None else None, rid=meta.id,
        finish_message=meta.finish_reason.message)


class EngineClient:
    """One ``httpx.AsyncClient`` reused for every call; close with ``aclose()`` or ``async with``."""

    def __init__(self, router_url: str, timeout: float = 300.0,
                 transport: httpx.AsyncBaseTransport | None = None, token: str | None = None,
                 engines: Callable[[], Awaitable[list[str]]] | None = None) -> None:
        self.router_url = router_url.rstrip("/")
        self.timeout = timeout  # a generate call's floor; it waits 4 x the slowest recent one when longer
        self.engines = engines  # the engines' URLs: a timed-out call's requests are aborted on each
        self.latency = LatencyWindow()
        self._http = httpx.AsyncClient(timeout=timeout, transport=transport, headers=bearer(token))

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                    wait_s: float | None = None) -> httpx.Response:
        try:
            return await self._http.post(url, json=body, headers=headers,
                                         **({"timeout": wait_s} if wait_s else {}))
        except httpx.HTTPError as exc:
            raise EngineClientError(f"POST {url} failed: {exc!r}") from exc

    async def generate(self, input_ids: list[int], sampling: dict[str, Any], rid: str,
                       lora: str | None = None) -> GenerateResult:
        """Generate through the router (under the loaded adapter ``lora``, when given); the logprobs are those of
        the sampled tokens."""
        body = {"input_ids": list(input_ids), "sampling_params": dict(sampling), "return_logprob": True,
                "rid": rid} | ({"lora_path": lora} if lora is not None else {})
        return _result(await self._generate_call(body, rid, [rid]), rid)

    async def generate_batch(self, prompts: list[list[int]], sampling: dict[str, Any],
                             rid: str, lora: str | None = None) -> list[GenerateResult | EngineClientError]:
        """One batch ``/generate`` (SGLang's: a list of prompts, one shared ``sampling_params``; the router
        takes no per-prompt parameters) with request ids ``{rid}_{i}``; per prompt its result, or the error
        its item alone came back with (the call's own failure raises ``EngineClientError``)."""
        body = {"input_ids": [list(p) for p in prompts], "sampling_params": dict(sampling), "return_logprob": True,
                "rid": rid} | ({"lora_path": lora} if lora is not None else {})
        items = await self._generate_call(body, rid, [f"{rid}_{i}" for i in range(len(prompts))])
        if not isinstance(items, list) or len(items) != len(prompts):
            got = f"{len(items)} replies" if isinstance(items, list) else type(items).__name__
            raise EngineClientError(f"generate {rid}: a batch of {len(prompts)} answered with {got}")
        out: list[GenerateResult | EngineClientError] = []
        for i, item in enumerate(items):
            try:
                out.append(_result(item, f"{rid}_{i}"))
            except EngineClientError as exc:
                out.append(exc)
        return out

    async def _generate_call(self, body: dict[str, Any], rid: str, rids: list[str]) -> Any:
        """Waits ``timeout`` or 4 x the slowest recent call: a slow engine's turn is not given up and sent again.
        A call that times out has its requests (``rids``) aborted on the engines before the error is raised, so
        a retry does not run beside the old copy."""
        started = time.monotonic()
        try:
            resp = await self._post(f"{self.router_url}/generate", body, wait_s=self.latency.bound(self.timeout))
        except EngineClientError as exc:
            if isinstance(exc.__cause__, httpx.TimeoutException):
                await self.abort(rids, why=f"generate {rid} timed out")
            raise
        if resp.status_code == 200:
            self.latency.add(time.monotonic() - started)
        if resp.status_code != 200:
            raise EngineClientError(f"generate {rid}: HTTP {resp.status_code}: {_error_message(resp)}",
                                    resp.status_code)
        try:
            return orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            pass
        try:  # Python's json also reads NaN and Infinity (a misbehaving engine's logprobs: rejected later, by name)
            return json.loads(resp.content)
        except ValueError as exc:
            raise EngineClientError(f"generate {rid}: unparseable reply: {exc}") from exc

    async def abort(self, rids: list[str], why: str) -> int:
        """Best effort: ``/abort_request`` each of ``rids`` on every engine (the router does not fan it out);
        logged, never raised. Returns how many requests the engines aborted."""
        if self.engines is None or not rids:
            return 0
        try:
            urls = await self.engines()
        except Exception as exc:  # noqa: BLE001 - best effort: the retry goes on regardless
            log.warning("%s: cannot list the engines to abort its %d request(s): %r", why, len(rids), exc)
            return 0
        answers = await asyncio.gather(*(self._abort_one(url, r) for url in urls for r in rids),
                                       return_exceptions=True)
        aborted = sum(a for a in answers if isinstance(a, int))
        failed = [a for a in answers if isinstance(a, BaseException)]
        log.warning("%s: aborted %d of its %d request(s) on %d engine(s)%s", why, aborted, len(rids), len(urls),
                    f"; {len(failed)} abort call(s) failed, e.g. {failed[0]!r}" if failed else "")
        return aborted

    async def _abort_one(self, engine_url: str, rid: str) -> int:
        resp = await self._http.post(f"{engine_url.rstrip('/')}/abort_request", json={"rid": rid},
                                     timeout=ABORT_WAIT_S)
        resp.raise_for_status()
        return int(resp.json().get("num_aborted", 0))

    async def update_weights(self, engine_url: str, model_path: str, version: int,
                             proof: WeightsProof | None = None) -> None:
        """Load ``model_path`` into one engine as ``version`` (with the trainer's ``proof``: the engine checks
        it, services/common/weights_auth.py); raise unless it reports success."""
        url = f"{engine_url.rstrip('/')}/update_weights_from_disk"
        body = UpdateWeightFromDiskReqInput(model_path=str(model_path), weight_version=str(version))
        resp = await self._post(url, body.model_dump(exclude_none=True), proof.headers() if proof else None)
        try:
            out = UpdateWeightFromDiskReqOutput.model_validate(resp.json())
        except (ValueError, ValidationError):
            raise EngineClientError(f"{url}: HTTP {resp.status_code}: {_error_message(resp)}") from None
        if not out.success:
            raise EngineClientError(f"{url}: weights {model_path} v{version} not loaded: {out.message}")

    async def load_adapter(self, engine_url: str, name: str, path: str, proof: WeightsProof | None = None) -> None:
        """Load the adapter directory ``path`` into one engine as ``name`` (with the trainer's ``proof``, which the
        engine checks); raise unless it reports success or that it already holds ``name`` (the rollouts sharing an
        engine each load their agent's adapters, and its owner restores them on a restarted engine: either may
        come first). Both engines refuse a second load of a name with a 400 saying it is "already loaded"."""
        body = LoadLoRAAdapterReqInput(lora_name=name, lora_path=str(path))
        try:
            await self._adapter_call(f"{engine_url.rstrip('/')}/load_lora_adapter", body.model_dump(),
                                     proof.headers() if proof else None)
        except EngineClientError as exc:
            if exc.status != 400 or (name not in exc.loaded and "already loaded" not in str(exc)):
                raise

    async def unload_adapter(self, engine_url: str, name: str) -> None:
        """Unload the adapter ``name`` from one engine (it waits for the requests that name it)."""
        body = UnloadLoRAAdapterReqInput(lora_name=name)
        await self._adapter_call(f"{engine_url.rstrip('/')}/unload_lora_adapter", body.model_dump())

    async def _adapter_call(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        resp = await self._post(url, body, headers)
        try:
            out = LoRAUpdateOutput.model_validate(resp.json())
        except (ValueError, ValidationError):
            raise EngineClientError(f"{url}: HTTP {resp.status_code}: {_error_message(resp)}",
                                    resp.status_code) from None
        if not out.success or resp.status_code != 200:
            raise EngineClientError(f"{url}: {body['lora_name']}: {out.error_message}", resp.status_code,
                                    out.loaded_adapters)
