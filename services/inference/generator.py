"""The embedded engine's core: one model, one worker thread, continuous batching.

The worker thread owns the model and loops step by step. Each step it
1. runs a pending weight load when it may (see below);
2. admits queued requests (up to ``max_batch`` rows) once admission is due: prompts are prefilled together
   (left-padded) and their KV merged into the running batch's cache; the longest prefix the prefix cache
   holds (an episode's earlier turns: ``prefix_cache.py``) is taken from it, and finished rows' KV goes to it;
3. decodes one token for every running row, samples per row (temperature, top-p, top-k, its own
   seeded generator) and lets finished rows leave the batch (their cache rows are dropped).

Admission in short windows, so that one-by-one HTTP arrivals prefill together: queued requests are
admitted once none arrived for ``admit_quiet_s``, the oldest waited ``admit_window_s``, or they fill the
batch (defaults 0 in process; 2 ms and 20 ms over HTTP); ``generate_many`` (SGLang's batch ``/generate``)
admits its requests at once.

A token's logprob is ``log_softmax(logits / T)[tok]`` in float32, as the trainer computes it.

Weight updates (``/update_weights_from_disk``) follow SGLang: unpaused, the load waits for the running
requests to finish (each runs wholly on one version); paused (``in_place``), it happens at once and each
request records where its version changed (``meta_info.weight_versions`` spans). LoRA adapters sit on the
resident base by name; a request naming one (``lora_path``) has it applied to its rows only.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.adapter_dir import base_of, is_adapter_dir
from services.common.devices import dtype_of, resolve
from services.common.latency import LatencyWindow
from services.inference.adapters import LoraAdapters, merge, read_adapter
from services.inference.batch import RunningBatch
from services.inference.prefix_cache import PrefixCache, prefill_inputs, row_kv, sequence_tokens
from services.inference.request import Completion, EngineError, GenRequest, resolve_all
from services.inference.sampling import sample
from services.inference.weights import load_weights

log = logging.getLogger("tandem.engine")
_GREEDY_BELOW = 1e-6  # as in SGLang: a lower temperature means greedy, logprobs of T = 1

__all__ = ["Engine", "EngineError", "GenRequest"]

_Op = tuple[Callable[[], Any], Completion]


class Engine:
    """The model plus its worker thread. Thread-safe; async entry points."""

    def __init__(self, model_path: str | Path, weight_version: int = 0, max_batch: int = 64,
                 admit_quiet_s: float = 0.0, admit_window_s: float = 0.0, device: str = "cpu",
                 dtype: str = "float32", prefix_cache_mb: float = 0.0,
                 step_delay_s: float = 0.0) -> None:
        torch.set_num_threads(1)
        self.model_path = str(model_path)
        self.device = resolve(device, "embedded.device")
        base = base_of(self.model_path)  # an adapter directory: its base, with the adapter merged in
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype_of(dtype))
        self.model = model.to(self.device).eval()
        if is_adapter_dir(self.model_path):
            merge(self.model, read_adapter(self.model, "merged", self.model_path))
        self.adapters = LoraAdapters(self.model)  # named adapters chosen per request (lora_path)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
        eos = [self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)]
        self.eos_ids = frozenset(t for c in eos if c is not None for t in ([c] if isinstance(c, int) else c))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        self.weight_version = int(weight_version)
        self.max_batch = max(1, int(max_batch))
        self.admit_quiet_s, self.admit_window_s = float(admit_quiet_s), float(admit_window_s)
        self.step_delay_s = float(step_delay_s)  # a pause before each decode step: a deliberately slow engine
        self._cv = threading.Condition()
        self._queue: list[GenRequest] = []
        self._last_arrival = 0.0
        self._whole_call = False  # a call of several requests is queued: admit without waiting for more
        self._batch = RunningBatch()
        self.prefix = PrefixCache(int(prefix_cache_mb * 2**20))
        self._ops: list[_Op] = []
        self.paused = False
        self._stopped = False
        self.last_step_at = time.monotonic()
        self.step_started_at: float | None = None  # while the model thread is inside a step (a long prefill)
        self.step_seconds = LatencyWindow()  # recent steps' durations (the health probe's patience follows them)
        # prefills; decode steps; requests that joined a running batch; that left while others ran on;
        # seconds the model thread spent in steps (prefills, decodes, sampling: busy, not waiting for work);
        # prompt tokens fed to prefills, and taken from the prefix cache instead; requests aborted as their client left
        self.stats: dict[str, float] = {"prefills": 0, "decode_steps": 0, "joined_running": 0, "left_running": 0,
                                        "busy_s": 0.0, "prefill_tokens": 0, "cached_tokens": 0, "client_aborts": 0}
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    # ----- entry points (any thread / the event loop) -----

    def check(self, req: GenRequest) -> None:
        """Raise EngineError when the request cannot be served."""
        if not req.input_ids:
            raise EngineError("input_ids is empty")
        self.adapters.check(req.lora)
        bad = [t for t in [*req.input_ids, *req.stop_token_ids] if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} out of vocabulary (size {self.vocab_size})")
        if len(req.input_ids) >= self.context_len:
            raise EngineError(f"prompt of {len(req.input_ids)} tokens exceeds the context length")
        req.max_new_tokens = min(req.max_new_tokens, self.context_len - len(req.input_ids))

    async def generate(self, req: GenRequest) -> GenRequest:
        return (await self.generate_many([req]))[0]

    async def generate_many(self, reqs: list[GenRequest]) -> list[GenRequest]:
        """Queue every request at once (they may share one prefill); their results, in order."""
        for r in reqs:
            self.check(r)
        now = time.monotonic()
        for r in reqs:
            r.done, r.queued_at = Completion(), now
        with self._cv:
            wake = (not self._queue or len(reqs) > 1
                    or len(self._queue) + len(reqs) >= self.max_batch - len(self._batch.rows))
            self._queue.extend(reqs)
            self._last_arrival = now
            self._whole_call = self._whole_call or len(reqs) > 1  # the caller gathered them (a batch /generate)
            if wake:  # otherwise the worker is decoding or in a timed wait for the admission window
                self._cv.notify_all()
        try:
            return list(await asyncio.gather(*(r.done.future for r in reqs if r.done is not None)))
        except asyncio.CancelledError:
            with self._cv:  # the client went away: queued ones go, running rows leave at the next step
                for r in reqs:
                    r.aborted = True
                self._queue = [q for q in self._queue if not q.aborted]
                self._cv.notify_all()  # a paused worker drops the frozen rows now, not at continue
            raise

    async def run_op(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread once no request is running (or at once while paused)."""
        done = Completion()
        with self._cv:
            self._ops.append((fn, done))
            self._cv.notify_all()
        return await done.future

    async def update_weights(self, model_path: str, version: int | None, abort_all: bool = False) -> int:
        if abort_all:
            self.abort(abort_all=True)
        return int(await self.run_op(lambda: self._load_weights(model_path, version)))

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort queued and running requests by rid (or all); returns how many."""
        with self._cv:
            hit = [r for r in self._queue + self._batch.rows + self._batch.joining if abort_all or r.rid == rid]
            queued = [r for r in hit if r in self._queue]
            for r in hit:
                r.aborted = True
            for r in queued:  # queued: answer now; running: at the next step
                r.abort()
            self._queue = [q for q in self._queue if not q.aborted]
            resolve_all(queued)
            self._cv.notify_all()
        return len(hit)

    def set_paused(self, paused: bool, mode: str = "in_place") -> int:
        """Pause (``abort``: abort everything first; ``in_place``/``retract``: running requests stay
        in the batch, frozen) or continue. Weight loads run while paused. Returns requests aborted."""
        aborted = self.abort(abort_all=True) if paused and mode == "abort" else 0
        with self._cv:
            self.paused = paused
            self._cv.notify_all()
        return aborted

    def load(self) -> dict[str, int]:
        with self._cv:
            reqs = self._queue + self._batch.rows + self._batch.joining
            tokens = sum(len(r.input_ids) + len(r.output_ids) for r in reqs)
            return {"num_reqs": len(reqs), "num_waiting_reqs": len(self._queue), "num_tokens": tokens}

    def names_adapter(self, name: str) -> bool:
        """Whether a queued or running request is generated under the adapter ``name``."""
        with self._cv:
            return any(r.lora == name for r in (*self._queue, *self._batch.rows, *self._batch.joining))

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ----- the worker thread -----

    def _loop(self) -> None:
        while (work := self._next_work()) is not None:
            ops, admit, idle = work
            for fn, done in ops:
                try:
                    done.resolve(self._run_op(fn))
                except Exception as exc:  # noqa: BLE001 - handed to the caller, the engine goes on
                    done.resolve(exc=exc)
            if idle and not self._drop_aborted():
                continue
            started = time.perf_counter()
            try:
                self._step(admit)
            except Exception as exc:
                log.exception("step failed; aborting the %d running request(s)", len(self._batch.rows))
                self._fail_all(f"engine error: {exc}", also=admit)
            self.stats["busy_s"] += time.perf_counter() - started
            self.step_seconds.add(time.perf_counter() - started)
        self._fail_all("engine stopped")

    def _next_work(self) -> tuple[list[_Op], list[GenRequest], bool] | None:
        """Under the lock: (weight ops to run, requests to admit, idle-while-paused); None once stopped.
        Waits while there is nothing to do, or only queued requests whose admission is not yet due."""
        with self._cv:
            while not self._stopped:
                ops: list[_Op] = []
                if self._ops and (self.paused or not self._batch.rows):
                    ops, self._ops = self._ops, []
                admit = [] if ops else self._admit_now()
                if ops or admit or (self._batch.rows and not self.paused):
                    return ops, admit, False
                if self._batch.rows:  # paused with rows frozen in the batch: wait for continue, an op, an abort
                    self._cv.wait(timeout=0.5)
                    return [], [], True
                self._cv.wait(timeout=self._admission_in())
            return None

    def _admission_in(self) -> float | None:
        """Seconds until the queue's admission is due (0: now); None: nothing may be admitted."""
        if self.paused or self._ops or not self._queue:
            return None
        room = self.max_batch - len(self._batch.rows)
        if room <= 0:
            return None
        if len(self._queue) >= room or self._whole_call:
            return 0.0
        due = min(self._last_arrival + self.admit_quiet_s, self._queue[0].queued_at + self.admit_window_s)
        return max(0.0, due - time.monotonic())

    def _admit_now(self) -> list[GenRequest]:
        if self._admission_in() != 0.0:
            return []
        room = self.max_batch - len(self._batch.rows)
        admit, self._queue = self._queue[:room], self._queue[room:]
        self._whole_call = False
        self._batch.joining = admit
        return admit

    def _run_op(self, fn: Callable[[], Any]) -> Any:
        old = self.weight_version
        result = fn()
        if self.weight_version != old:  # loaded while paused in place: record the switch per request
            for r in self._batch.rows:
                if r.output_ids:
                    r.version_events.append((old, len(r.output_ids)))
                r.weight_version = self.weight_version
        return result

    def _fail_all(self, message: str, also: list[GenRequest] | None = None) -> None:
        rows = [*self._batch.rows, *(also or [])]
        with self._cv:
            rows += self._queue if self._stopped else []
            self._batch = RunningBatch()
        for r in rows:
            r.abort(message)
        resolve_all(rows)

    def _drop_aborted(self) -> bool:
        gone = [i for i, r in enumerate(self._batch.rows) if r.aborted]
        for i in gone:
            self._batch.rows[i].abort()
        self._leave(gone)
        return bool(gone)

    def _leave(self, idx: list[int]) -> None:
        if not idx:
            return
        self._keep_prefixes(idx)
        with self._cv:
            left = self._batch.remove(idx)
            self.stats["left_running"] += len(left) if self._batch.rows else 0
        resolve_all(left)

    def _keep_prefixes(self, idx: list[int]) -> None:
        """Store the KV of rows that finished wholly on the current weights in the prefix cache."""
        b = self._batch
        for i in idx if self.prefix.enabled and b.cache is not None else []:
            r = b.rows[i]
            if r.aborted or r.version_events or r.weight_version != self.weight_version or not r.output_ids:
                continue
            kv, tokens = row_kv(b.cache, b.mask, i), sequence_tokens(r)
            if kv and kv[0][0].shape[1] == len(tokens):
                self.prefix.store(tokens, kv, r.lora)

    def _step(self, admit: list[GenRequest]) -> None:
        self.step_started_at = time.monotonic()
        try:
            self._step_inner(admit)
        finally:
            self.step_started_at = None

    @torch.inference_mode()
    def _step_inner(self, admit: list[GenRequest]) -> None:
        if admit:
            self._prefill(admit)
        self._drop_aborted()
        if not self._batch.rows or self.paused:
            return
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        b = self._batch
        with self.adapters.rows([r.lora for r in b.rows], self.device):
            out = self.model(input_ids=b.last_tokens[:, None], attention_mask=b.decode_mask(),
                             position_ids=b.next_pos[:, None], past_key_values=b.cache, use_cache=True)
        b.advance()
        self.stats["decode_steps"] += 1
        self.last_step_at = time.monotonic()
        self._take(b.rows, out.logits[:, -1, :].float(), all_rows=True)

    def _prefill(self, reqs: list[GenRequest]) -> None:
        live = []
        for r in reqs:
            r.weight_version = self.weight_version
            r.gen = torch.Generator().manual_seed(r.seed if r.seed is not None else random.getrandbits(62))
            if r.aborted:
                r.abort()
            elif r.max_new_tokens <= 0:
                r.finish = {"type": "length", "length": 0}
            else:
                live.append(r)
        resolve_all([r for r in reqs if r.finish is not None])
        if not live:
            with self._cv:
                self._batch.joining = []
            return
        p = prefill_inputs(live, self.prefix, self.pad_id, self.device)
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += sum(p.new)
        self.stats["cached_tokens"] += sum(p.cached)
        mask, pos = p.mask, p.pos
        with self.adapters.rows([r.lora for r in live], self.device):  # the last position's logits only
            out = self.model(input_ids=p.ids, attention_mask=mask, position_ids=pos, past_key_values=p.cache,
                             use_cache=True, logits_to_keep=1)
        toks, lps = self._sample(out.logits[:, -1, :].float(), live)
        with self._cv:
            self.stats["joined_running"] += len(live) if self._batch.rows else 0
            self._batch.join(live, out.past_key_values, mask, pos[:, -1] + 1, torch.tensor(toks, device=self.device))
        start = len(self._batch.rows) - len(live)
        self._record(list(range(start, start + len(live))), toks, lps)

    def _take(self, rows: list[GenRequest], logits: torch.Tensor, all_rows: bool) -> None:
        toks, lps = self._sample(logits, rows)
        self._batch.last_tokens = torch.tensor(toks, device=self.device)
        self._record(list(range(len(rows))), toks, lps)

    def _record(self, idx: list[int], toks: list[int], lps: list[float]) -> None:
        """Append each row's sampled token; rows that finish leave the batch."""
        finished = []
        for i, tok, lp in zip(idx, toks, lps, strict=True):
            r = self._batch.rows[i]
            if r.aborted:
                r.abort()
            else:
                r.output_ids.append(tok)
                r.logprobs.append(lp)
                if tok in r.stop_token_ids or (tok in self.eos_ids and not r.ignore_eos):
                    r.finish = {"type": "stop", "matched": tok}
                elif r.stop_strings and (hit := self._stop_string(r)) is not None:
                    r.finish = {"type": "stop", "matched": hit}
                elif len(r.output_ids) >= r.max_new_tokens:
                    r.finish = {"type": "length", "length": len(r.output_ids)}
            if r.finish is not None:
                finished.append(i)
        self._leave(finished)

    def _sample(self, logits: torch.Tensor, rows: list[GenRequest]) -> tuple[list[int], list[float]]:
        return sample(logits, [r.temperature for r in rows], [r.top_p for r in rows], [r.top_k for r in rows],
                      [r.gen for r in rows])


    def _stop_string(self, r: GenRequest) -> str | None:
        tail = self.tokenizer.decode(r.output_ids[-64:])
        return next((s for s in r.stop_strings if s and s in tail), None)

    def _load_weights(self, model_path: str, version: int | None) -> int:
        load_weights(self.model, model_path)
        self.prefix.clear()
        self.weight_version = int(version) if version is not None else self.weight_version + 1
        log.info("loaded weights from %s as version %d", model_path, self.weight_version)
        return self.weight_version
