"""The Tinker API service's core: record every request, run each model's operations in ``seq_id`` order.

A training request is written to Redis (``Store.submit``) before its ``request_id`` is
answered. Each model has one runner task that takes the model's operation log in order:
seq 0 creates the model (``create_model`` or a create-from-state load), then the SDK's
requests 1, 2, ...; a request that arrives early waits for the ones before it, and a
repeated ``seq_id`` maps to the request already recorded, so it has no second effect.

After a restart nothing is in memory: a model's runner rebuilds it by running its log
again from seq 0 (creation, loads, forward_backward, optim_step are deterministic; saves
that already finished are skipped), then runs what is still pending. Sampling requests
have no order; pending ones are run again at start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.tinker_api import wire
from services.tinker_api.checkpoints import UrlSigner
from services.tinker_api.custom_loss import CustomLoss
from services.tinker_api.losses import Conflict, UserError
from services.tinker_api.sampler import SamplerPool, sample
from services.tinker_api.store import CONFLICT, NEW, Store
from services.tinker_api.workshop import Workshop, check_name

log = logging.getLogger("tandem.tinker_api")
JSON = "application/json"
PROTO = "application/x-protobuf"
NO_REPLAY = {"save_weights", "save_for_sampler", "save_external"}


def model_dir(base_model: str, models: dict[str, Path]) -> str:
    """The local directory of a base model: a served hub name (``tandem serve --model NAME=DIR``) or a directory."""
    if base_model in models:
        return str(models[base_model])
    if not (Path(base_model) / "config.json").is_file():
        served = f" nor one of the served names {sorted(models)}" if models else ""
        raise UserError(f"base_model: {base_model!r} is not a local model directory (no config.json){served}")
    return str(Path(base_model).resolve())


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


class TinkerService:
    def __init__(self, store: Store, data_dir: Path, sampler_capacity: int = 4, device: str = "cpu",
                 models: dict[str, Path] | None = None) -> None:
        self.store = store
        self.models = dict(models or {})
        self.workshop = Workshop(data_dir, device, self.local_dir)
        self.samplers = SamplerPool(sampler_capacity)
        self.signer = UrlSigner(data_dir)
        self.sampler_used: dict[str, float] = {}  # sampling session -> when it last sampled (for the reaper)
        self.session_used: dict[str, float] = {}  # session -> its last training request (for the reaper)
        self.trainer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._done: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle ----------------------------------------------------------------------
    async def recover(self) -> int:
        """Run every request left pending by an earlier process; returns how many."""
        pending = await self.store.pending()
        for rid in pending:
            req = await self.store.request(rid)
            if req is None:
                continue
            if req["kind"] == b"sample":
                self._spawn(self._run_sample(rid, req))
            else:
                self.ensure_runner(req["scope"].decode())
        return len(pending)

    async def close(self) -> None:
        for task in [*self._runners.values(), *self._tasks]:
            task.cancel()
        await asyncio.gather(*self._runners.values(), *self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.samplers.stop)
        self.trainer_thread.shutdown(wait=True, cancel_futures=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _train(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.trainer_thread, fn, *args)

    def loaded(self) -> dict[str, int]:
        """What this process holds now: training clients in memory, sampler engines loaded."""
        return {"models_loaded": len(self.workshop.clients), "engines_loaded": len(self.samplers.loaded())}

    async def finish_session(self, session_id: str) -> int:
        """A finished session's models leave memory, its ephemeral snapshots the disk (named checkpoints and
        the request logs stay); returns how many models."""
        prefix = f"{session_id}:train:"
        gone = [m for m in self._runners if m.startswith(prefix)]
        for model_id in gone:
            self._runners.pop(model_id).cancel()
            dirs = await self._train(self.workshop.drop, model_id)
            await self.samplers.forget(dirs)
        return len(gone)

    # -- requests -----------------------------------------------------------------------
    async def submit_op(self, kind: str, model_id: str, seq: int, body: bytes, ctype: str = JSON) -> str:
        """Record a model operation (after the model's creation) and wake its runner."""
        if seq != 0 and await self.store.op_at(model_id, 0) is None:
            raise UserError(f"model_id: unknown model {model_id!r}")
        rid, outcome = await self.store.submit(kind, model_id, seq, body, ctype)
        self.session_used[model_id.rsplit(":train:", 1)[0]] = time.time()
        if outcome == CONFLICT:
            raise Conflict(f"seq_id: {seq} of model {model_id} was already submitted with a different body "
                           "(conflict: the first request stands)")
        self.ensure_runner(model_id)
        self._wake.setdefault(model_id, asyncio.Event()).set()
        return rid

    async def refuse_op(self, kind: str, model_id: str, seq: int, body: bytes, ctype: str, message: str) -> bool:
        """A request refused at submission takes its ``seq_id`` as a failed operation, so the model's runner
        goes on to the next one; False when there is no such model or the ``seq_id`` is taken already."""
        if seq < 1 or await self.store.op_at(model_id, 0) is None:
            return False
        error = _json({"error": message, "category": "user"})
        _, outcome = await self.store.submit(kind, model_id, seq, body, ctype, refused=error)
        if outcome != NEW:
            return False
        self.ensure_runner(model_id)
        self._wake.setdefault(model_id, asyncio.Event()).set()
        return True

    async def create_custom_loss(self, req: wire.CreateCustomLoss, body: bytes) -> str:
        """Check the loss graph and store it (``{session}:loss:{seq}``); a refused one is recorded at its seq as
        failed. The request is answered at once: its future is already done."""
        if await self.store.get("session", req.session_id) is None:
            raise UserError(f"session_id: unknown session {req.session_id!r}")
        scope, seq = f"{req.session_id}:loss", req.custom_loss_seq_id
        loss_id = f"{scope}:{seq}"
        try:
            CustomLoss(req.name, req.inputs, req.graph)
        except UserError as exc:
            await self.store.submit("create_custom_loss", scope, seq, body, JSON,
                                    refused=_json({"error": str(exc), "category": "user"}))
            raise
        rid, outcome = await self.store.submit("create_custom_loss", scope, seq, body, JSON,
                                               answered=_json({"loss_id": loss_id, "type": "create_custom_loss"}))
        if outcome == CONFLICT:
            raise Conflict(f"custom_loss_seq_id: {seq} of session {req.session_id} was already submitted with a "
                           "different body (conflict: the first request stands)")
        await self.store.put("loss", loss_id, {"loss_id": loss_id, "session_id": req.session_id, "name": req.name,
                                               "inputs": req.inputs, "graph": req.graph}, only_new=True)
        return rid

    async def custom_loss(self, model_id: str, body: bytes) -> dict[str, Any] | None:
        """The stored custom loss a forward_backward names (None for a built-in loss); it must be its session's."""
        loss_id = wire.custom_loss_id(body)
        if loss_id is None:
            return None
        record = await self.store.get("loss", loss_id)
        if record is None or record["session_id"] != model_id.rsplit(":train:", 1)[0]:
            raise UserError(f"loss_fn_config.loss_id: no custom loss {loss_id!r} in this model's session")
        return record

    async def create_model(self, req: wire.CreateModel) -> tuple[str, str]:
        if await self.store.get("session", req.session_id) is None:
            raise UserError(f"session_id: unknown session {req.session_id!r}")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        lora = req.lora_config or wire.LoraSpec()
        if req.optimizer_config and req.optimizer_config.get("type", "adamw") != "adamw":
            raise UserError(f"optimizer_config: only adamw is served here, got {req.optimizer_config.get('type')!r}")
        spec = {"base_model": req.base_model, "rank": lora.rank,
                "seed": lora.seed if lora.seed is not None else random.getrandbits(31),
                "train_mlp": lora.train_mlp, "train_attn": lora.train_attn, "train_unembed": lora.train_unembed,
                "session_id": req.session_id, "user_metadata": req.user_metadata or {},
                "created": time.time()}
        await self.store.put("model", model_id, spec, only_new=True)
        rid = await self.submit_op("create_model", model_id, 0, req.model_dump_json().encode())
        return rid, model_id

    async def load_create(self, req: wire.LoadWeights) -> tuple[str, str]:
        if req.session_id is None or req.model_seq_id is None:
            raise UserError("load_weights: give session_id and model_seq_id (create from state), or model_id and "
                            "seq_id (load into a model)")
        if await self.store.get("session", req.session_id) is None:
            raise UserError(f"session_id: unknown session {req.session_id!r}")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        rid = await self.submit_op("load_create", model_id, 0, req.model_dump_json().encode())
        return rid, model_id

    async def submit_sample(self, req: wire.Sample, body: bytes) -> tuple[str, list[str]]:
        if req.sampling_session_id is not None:
            if await self.store.get("sampler", req.sampling_session_id) is None:
                raise UserError(f"sampling_session_id: unknown sampling session {req.sampling_session_id!r}")
            scope, seq = req.sampling_session_id, req.seq_id if req.seq_id is not None else time.time_ns()
            self.sampler_used[scope] = time.time()
        else:
            await self.sampler_weights(req.base_model, req.model_path)  # validates before recording
            scope, seq = "direct", time.time_ns()
        rid, outcome = await self.store.submit("sample", scope, int(seq), body, JSON)
        if outcome == CONFLICT:
            raise Conflict(f"seq_id: {seq} of sampling session {scope} was already submitted with a different "
                           "body (conflict: the first request stands)")
        if outcome == NEW:
            self._spawn(self._run_sample(rid, await self.store.request(rid) or {}))
        return rid, [f"{rid}/{i}" for i in range(req.num_samples)]

    async def result(self, rid: str, wait_s: float) -> dict[str, bytes] | None:
        """The request record, once it has a result or ``wait_s`` has passed (long poll)."""
        deadline = time.monotonic() + wait_s
        while True:
            event = self._done.setdefault(rid, asyncio.Event())  # before the read: a finish after it sets it
            req = await self.store.request(rid)
            if req is None or req.get("state") != b"pending":
                self._done.pop(rid, None)
                return req
            if req.get("kind") != b"sample":  # a model dropped (its session expired) is rebuilt for its waiter
                self.ensure_runner(req["scope"].decode())
            left = deadline - time.monotonic()
            if left <= 0:
                return req
            try:
                await asyncio.wait_for(event.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                pass

    async def _finish(self, rid: str, ok: bool, result: bytes, rctype: str) -> None:
        await self.store.finish(rid, ok, result, rctype)
        event = self._done.pop(rid, None)
        if event is not None:
            event.set()

    async def _fail(self, rid: str, exc: BaseException) -> None:
        user = isinstance(exc, UserError | ValueError)
        if not user:
            log.exception("request %s failed", rid, exc_info=exc)
        message = str(exc) if user else f"internal error: {type(exc).__name__}: {exc}"
        await self._finish(rid, False, _json({"error": message, "category": "user" if user else "server"}), JSON)

    # -- sampling -----------------------------------------------------------------------
    async def sampler_weights(self, base_model: str | None, model_path: str | None) -> tuple[str, str]:
        """(weights directory, base model) of a sampler on a base model or a ``tinker://`` sampler path."""
        if model_path:
            out = await asyncio.to_thread(self.workshop.resolve, model_path, "sampler_weights")
            spec = await self.store.get("model", model_path[len("tinker://"):].split("/")[0])
            return str(out), (spec or {}).get("base_model", base_model or str(out))
        if not base_model:
            raise UserError("base_model: give a base model directory or a model_path")
        return await asyncio.to_thread(self.local_dir, base_model), base_model

    def local_dir(self, base_model: str) -> str:
        return model_dir(base_model, self.models)

    async def create_sampling_session(self, req: wire.CreateSamplingSession) -> str:
        if await self.store.get("session", req.session_id) is None:
            raise UserError(f"session_id: unknown session {req.session_id!r}")
        weights, base = await self.sampler_weights(req.base_model, req.model_path)
        sid = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        await self.store.put("sampler", sid, {"weights": weights, "base_model": base, "model_path": req.model_path,
                                              "session_id": req.session_id, "created": time.time()}, only_new=True)
        return sid

    async def _run_sample(self, rid: str, req: dict[str, bytes]) -> None:
        try:
            body = wire.Sample.model_validate_json(req["body"])
            if body.sampling_session_id is not None:
                rec = await self.store.get("sampler", body.sampling_session_id) or {}
                weights = rec["weights"]
                if not await asyncio.to_thread(Path(weights).is_dir):
                    raise UserError(f"sampling_session_id: the weights of {body.sampling_session_id} are gone "
                                    "(an ephemeral snapshot of a finished session)")
            else:
                weights, _ = await self.sampler_weights(body.base_model, body.model_path)
            await self._finish(rid, True, await sample(self.samplers, weights, body, rid), PROTO)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes the future's error
            await self._fail(rid, exc)

    # -- each model's ordered runner ----------------------------------------------------
    def ensure_runner(self, model_id: str) -> None:
        task = self._runners.get(model_id)
        if task is None or task.done():
            self._runners[model_id] = asyncio.create_task(self._run_model(model_id), name=f"model {model_id}")

    async def _run_model(self, model_id: str) -> None:
        seq = 0
        wake = self._wake.setdefault(model_id, asyncio.Event())
        while True:
            rid = await self.store.op_at(model_id, seq)
            if rid is None:
                wake.clear()
                if await self.store.op_at(model_id, seq) is None:
                    try:
                        await asyncio.wait_for(wake.wait(), timeout=5.0)
                    except TimeoutError:
                        pass
                continue
            req = await self.store.request(rid)
            seq += 1
            if req is None:
                continue
            kind = req["kind"].decode()
            replay = req["state"] != b"pending"
            if replay and (kind in NO_REPLAY or req["state"] == b"failed"):
                continue
            try:
                result, rctype = await self._execute(kind, model_id, req["body"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes the future's error
                if not replay:
                    await self._fail(rid, exc)
                continue
            if not replay:
                await self._finish(rid, True, result, rctype)

    async def _execute(self, kind: str, model_id: str, body: bytes) -> tuple[bytes, str]:
        w = self.workshop
        if kind == "forward_backward":
            out, _ = await self._train(w.forward_backward, model_id, body, await self.custom_loss(model_id, body))
            return out, PROTO
        if kind == "optim_step":
            return _json(await self._train(w.optim_step, model_id, wire.OptimStep.model_validate_json(body))), JSON
        if kind == "create_model":
            spec = await self.store.get("model", model_id)
            await self._train(w.create, model_id, spec)
            return _json({"model_id": model_id, "type": "create_model"}), JSON
        if kind in ("load_create", "load_weights"):
            return await self._load(kind, model_id, wire.LoadWeights.model_validate_json(body))
        if kind == "save_external":
            return await self._save_external(model_id, wire.SaveExternal.model_validate_json(body))
        req = wire.SaveWeights.model_validate_json(body)
        spec = await self.store.get("model", model_id) or {}
        if kind == "save_weights":
            path = await self._train(w.save_state, model_id, check_name(req.path), spec)
            return _json({"path": path, "type": "save_weights"}), JSON
        if req.path is None and req.sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler: give a path (name) or a sampling_session_seq_id")
        name = check_name(req.path) if req.path is not None else f"ephemeral-{req.seq_id}"
        path, out = await self._train(w.save_sampler, model_id, name)
        result: dict[str, Any] = {"path": path, "type": "save_weights_for_sampler"}
        if req.sampling_session_seq_id is not None:
            sid = f"{spec['session_id']}:sample:{req.sampling_session_seq_id}"
            await self.store.put("sampler", sid, {"weights": str(out), "base_model": spec["base_model"],
                                                  "model_path": path, "session_id": spec["session_id"],
                                                  "created": time.time()})
            result["sampling_session_id"] = sid
        return _json(result), JSON

    async def _save_external(self, model_id: str, req: wire.SaveExternal) -> tuple[bytes, str]:
        spec = await self.store.get("model", model_id) or {}
        path, size = await self._train(self.workshop.save_external, model_id, check_name(req.path),
                                       spec["base_model"], req.age_encryption_recipients)
        await self.store.set_expiry(path, None if req.ttl_seconds is None else time.time() + req.ttl_seconds)
        return _json({"path": path, "size_bytes": size, "type": "save_weights_external"}), JSON

    async def _load(self, kind: str, model_id: str, req: wire.LoadWeights) -> tuple[bytes, str]:
        if kind == "load_create":
            meta = await asyncio.to_thread(self.workshop.checkpoint_meta, req.path)
            session_id = model_id.rsplit(":train:", 1)[0]
            spec = {k: meta[k] for k in ("base_model", "rank", "seed", "train_mlp", "train_attn", "train_unembed")}
            if req.base_model:
                spec["base_model"] = req.base_model
            await self.store.put("model", model_id, {**spec, "session_id": session_id, "created": time.time(),
                                                     "user_metadata": req.user_metadata or {}})
            await self._train(self.workshop.create, model_id, spec)
        await self._train(self.workshop.load, model_id, req.path, req.optimizer)
        return _json({"path": req.path, "model_id": model_id, "type": "load_weights"}), JSON
