"""The embedded engine's core: one model, one worker thread, batched decoding.

The worker thread owns the model. Each round it runs pending control operations (weight loads),
then takes the queued requests (up to ``max_batch``) and decodes them as ONE batch: left-padded
prompts, attention mask, explicit position ids, KV cache, per-row temperature / top-p / top-k /
max_new_tokens / stop tokens (EOS always stops) / seed. A request thus runs wholly on one weight
version. A token's logprob is ``log_softmax(logits / T)[tok]`` in float32 (T = 0: plain ``log_softmax``),
as a trainer's full-sequence forward computes it. Async callers await an asyncio future that the
worker resolves through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

log = logging.getLogger("tandem.engine")
_GREEDY_BELOW = 1e-6  # as in SGLang: a lower temperature means greedy, logprobs of T = 1


class EngineError(ValueError):
    """A request the engine cannot serve as given (the HTTP layer answers 400)."""


class _Completion:
    """An asyncio future of the caller's loop, resolved from the worker thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] = self.loop.create_future()

    def _set(self, value: Any, exc: BaseException | None) -> None:
        if not self.future.done():  # done: the caller went away (cancelled)
            self.future.set_exception(exc) if exc is not None else self.future.set_result(value)

    def resolve(self, value: Any = None, exc: BaseException | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(self._set, value, exc)


@dataclass
class GenRequest:
    """One generation request and, once done, its result."""

    rid: str
    input_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    weight_version: int = -1
    aborted: bool = False
    done: _Completion | None = field(default=None, repr=False)


def _finish_abort(r: GenRequest) -> None:
    r.finish = r.finish or {"type": "abort", "message": f"request {r.rid} aborted"}


class Engine:
    """The model plus its worker thread. Thread-safe; async entry points."""

    def __init__(self, model_path: str | Path, weight_version: int = 0, max_batch: int = 64) -> None:
        torch.set_num_threads(1)
        self.model_path = str(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
        eos = [self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)]
        self.eos_ids = frozenset(t for c in eos if c is not None for t in ([c] if isinstance(c, int) else c))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        self.weight_version = int(weight_version)
        self.max_batch = max(1, int(max_batch))
        self._cv = threading.Condition()
        self._queue: list[GenRequest] = []
        self._running: list[GenRequest] = []
        self._ops: list[tuple[Callable[[], Any], _Completion]] = []
        self.paused = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    def check(self, req: GenRequest) -> None:
        """Raise EngineError when the request cannot be served."""
        bad = [t for t in [*req.input_ids, *req.stop_token_ids] if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} out of vocabulary (size {self.vocab_size})")
        if len(req.input_ids) >= self.context_len:
            raise EngineError(f"prompt of {len(req.input_ids)} tokens exceeds the context length")
        req.max_new_tokens = min(req.max_new_tokens, self.context_len - len(req.input_ids))

    async def generate(self, req: GenRequest) -> GenRequest:
        self.check(req)
        req.done = _Completion()
        with self._cv:
            self._queue.append(req)
            self._cv.notify_all()
        try:
            return await req.done.future
        except asyncio.CancelledError:
            req.aborted = True  # the client went away: free its batch row
            with self._cv, contextlib.suppress(ValueError):
                self._queue.remove(req)
            raise

    async def run_op(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread between two batches."""
        done = _Completion()
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
            hit = [r for r in self._queue + self._running if abort_all or r.rid == rid]
            for r in hit:
                r.aborted = True
                if r in self._queue and r.done is not None:  # queued: answer now; running: at next step
                    self._queue.remove(r)
                    _finish_abort(r)
                    r.done.resolve(r)
        return len(hit)

    def set_paused(self, paused: bool) -> None:
        """Paused: queued and new requests wait; a running batch finishes; weight loads still run."""
        with self._cv:
            self.paused = paused
            self._cv.notify_all()

    def load(self) -> dict[str, int]:
        with self._cv:
            reqs = self._queue + self._running
            tokens = sum(len(r.input_ids) + len(r.output_ids) for r in reqs)
            return {"num_reqs": len(reqs), "num_waiting_reqs": len(self._queue), "num_tokens": tokens}

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not self._ops and (self.paused or not self._queue):
                    self._cv.wait()
                if self._stopped:
                    return
                ops, self._ops = self._ops, []
                batch: list[GenRequest] = []
                if not ops:
                    batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
                    self._running = batch
            for fn, done in ops:
                try:
                    done.resolve(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller, the engine goes on
                    done.resolve(exc=exc)
            if not batch:
                continue
            try:
                self._generate(batch)
            except Exception as exc:
                log.exception("batch of %d failed", len(batch))
                for r in batch:
                    if r.finish is None:
                        r.finish = {"type": "abort", "message": f"engine error: {exc}"}
            finally:
                with self._cv:
                    self._running = []
                for r in batch:
                    if r.done is not None:
                        r.done.resolve(r)

    def _load_weights(self, model_path: str, version: int | None) -> int:
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise EngineError(f"no .safetensors files in {model_path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                state.update(load_file(str(f)))
            except Exception as exc:
                raise EngineError(f"cannot read {f}: {exc}") from exc
        expected = self.model.state_dict()
        tied = getattr(self.model.config, "tie_word_embeddings", False) and "lm_head.weight" in expected
        if tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
        if missing or unexpected:
            raise EngineError(f"weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
        shapes = [k for k, v in expected.items() if tuple(v.shape) != tuple(state[k].shape)]
        if shapes:
            raise EngineError(f"shape mismatch for {shapes[:5]}")
        self.model.load_state_dict(state, strict=True)
        self.weight_version = int(version) if version is not None else self.weight_version + 1
        log.info("loaded weights from %s as version %d", model_path, self.weight_version)
        return self.weight_version

    def _sample(self, logits: torch.Tensor, rows: list[GenRequest],
                gens: list[torch.Generator]) -> tuple[list[int], list[float]]:
        temps = torch.tensor([r.temperature if r.temperature >= _GREEDY_BELOW else 1.0 for r in rows])
        greedy = torch.tensor([r.temperature < _GREEDY_BELOW for r in rows])
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        tok = logp.argmax(dim=-1)
        if not bool(greedy.all()):
            vocab = logp.shape[-1]
            sorted_lp, order = logp.sort(dim=-1, descending=True)
            probs = sorted_lp.exp()
            ks = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows])
            top_p = torch.tensor([r.top_p for r in rows])
            keep = torch.arange(vocab)[None, :] < ks[:, None]
            keep &= (probs.cumsum(dim=-1) - probs) < top_p[:, None]
            cdf = (probs * keep).cumsum(dim=-1)
            u = torch.stack([torch.rand((), generator=g) for g in gens]) * cdf[:, -1]
            idx = torch.searchsorted(cdf, u[:, None].contiguous(), right=True)
            idx = torch.minimum(idx, keep.sum(dim=-1, keepdim=True) - 1)
            tok = torch.where(greedy, tok, order.gather(1, idx).squeeze(1))
        lp = logp.gather(1, tok[:, None]).squeeze(1)
        return tok.tolist(), lp.tolist()

    @torch.inference_mode()
    def _generate(self, batch: list[GenRequest]) -> None:
        for r in batch:
            r.weight_version = self.weight_version
            if r.aborted:
                _finish_abort(r)
            elif r.max_new_tokens <= 0:
                r.finish = {"type": "length", "length": 0}
        rows = [r for r in batch if r.finish is None]
        if not rows:
            return
        n, width = len(rows), max(len(r.input_ids) for r in rows)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids, dtype=torch.long)
            mask[i, width - len(r.input_ids):] = 1
        pos = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(r.seed if r.seed is not None else random.getrandbits(62))
                for r in rows]
        stops = [r.stop_token_ids | self.eos_ids for r in rows]
        active = [True] * n
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         past_key_values=DynamicCache(), use_cache=True)
        next_pos = pos[:, -1:] + 1
        while True:
            toks, lps = self._sample(out.logits[:, -1, :].float(), rows, gens)
            for i, r in enumerate(rows):
                if not active[i]:
                    continue
                if r.aborted:
                    _finish_abort(r)
                else:
                    r.output_ids.append(toks[i])
                    r.logprobs.append(lps[i])
                    if toks[i] in stops[i]:
                        r.finish = {"type": "stop", "matched": toks[i]}
                    elif r.stop_strings and (hit := self._stop_string(r)) is not None:
                        r.finish = {"type": "stop", "matched": hit}
                    elif len(r.output_ids) >= r.max_new_tokens:
                        r.finish = {"type": "length", "length": len(r.output_ids)}
                active[i] = r.finish is None
            if not any(active):
                return
            feed = torch.tensor([t if a else self.pad_id for t, a in zip(toks, active, strict=True)])
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
            out = self.model(input_ids=feed[:, None], attention_mask=mask, position_ids=next_pos,
                             past_key_values=out.past_key_values, use_cache=True)
            next_pos = next_pos + 1

    def _stop_string(self, r: GenRequest) -> str | None:
        return next((s for s in r.stop_strings if s and s in self.tokenizer.decode(r.output_ids)), None)
