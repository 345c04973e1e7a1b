"""Sampling on Tandem's embedded engine: one continuous-batching ``Engine`` per weights directory.

A sampling client names fixed weights: a base model directory, or a snapshot the trainer
exported (merged LoRA, written once, never changed), so training that goes on never moves
a sampler. Engines are loaded lazily and kept in an LRU of ``capacity`` (an engine that is
serving a request is never evicted). Prompt logprobs come from one full forward pass of the
same engine's model, as the trainer computes them (float32, temperature 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import OrderedDict
from collections.abc import AsyncIterator

import torch

from services.inference import Engine, EngineError, GenRequest
from services.tinker_api import wire
from services.tinker_api.losses import UserError

DEFAULT_MAX_TOKENS = 256
MASK_LOGPROB = -99999.0  # the SDK's sentinel of an empty top-k row (tinker.types.topk_logprobs)


class SamplerPool:
    def __init__(self, capacity: int = 4, max_batch: int = 64) -> None:
        self.capacity = max(1, capacity)
        self.max_batch = max_batch
        self._engines: OrderedDict[str, Engine] = OrderedDict()
        self._busy: dict[str, int] = {}
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def engine(self, weights_dir: str) -> AsyncIterator[Engine]:
        async with self._lock:
            engine = self._engines.get(weights_dir)
            if engine is None:
                engine = await asyncio.to_thread(self._start, weights_dir)
                self._engines[weights_dir] = engine
            self._engines.move_to_end(weights_dir)
            self._busy[weights_dir] = self._busy.get(weights_dir, 0) + 1
            self._evict()
        try:
            yield engine
        finally:
            self._busy[weights_dir] -= 1

    def _start(self, weights_dir: str) -> Engine:
        """A new engine; the trainer's thread count is kept (an engine sets torch's to 1 for threads made later)."""
        threads = torch.get_num_threads()
        try:
            return Engine(weights_dir, 0, self.max_batch)
        finally:
            torch.set_num_threads(threads)

    def _evict(self) -> None:
        for key in list(self._engines):
            if len(self._engines) <= self.capacity:
                return
            if not self._busy.get(key):
                self._engines.pop(key).stop()

    async def forget(self, weights_dirs: list[str]) -> None:
        """Stop the idle engines of snapshots that are gone (a busy one finishes; the LRU drops it later)."""
        async with self._lock:
            idle = [self._engines.pop(k) for k in weights_dirs if k in self._engines and not self._busy.get(k)]
        for engine in idle:
            await asyncio.to_thread(engine.stop)

    def loaded(self) -> list[str]:
        return list(self._engines)

    def stop(self) -> None:
        for engine in self._engines.values():
            engine.stop()
        self._engines.clear()


def _stops(spec: wire.SamplingSpec) -> tuple[frozenset[int], tuple[str, ...], bool]:
    """(stop token ids, stop strings, ignore EOS): None keeps EOS; [] disables every stop, EOS included."""
    stop = spec.stop
    if stop is None:
        return frozenset(), (), False
    if isinstance(stop, str):
        return frozenset(), (stop,), False
    if not stop:
        return frozenset(), (), True
    if all(isinstance(s, int) for s in stop):
        return frozenset(int(s) for s in stop), (), False
    return frozenset(), tuple(str(s) for s in stop), False


def check_sample(req: wire.Sample) -> list[int]:
    if not 0 <= req.topk_prompt_logprobs <= 1000:
        raise UserError("topk_prompt_logprobs: must be between 0 and 1000")
    unsupported = {"topk_sample_logprobs": req.topk_sample_logprobs > 0,
                   "target_prompt_logprobs": req.target_prompt_logprobs is not None,
                   "prompt_alt_tokens_k": req.prompt_alt_tokens_k > 0}
    asked = [k for k, v in unsupported.items() if v]
    if asked:
        raise UserError(f"{asked[0]}: not served by this Tandem server")
    tokens = req.prompt.tokens()
    if not tokens:
        raise UserError("prompt: no tokens")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not 1 <= last_n <= len(tokens) - 1:
        raise UserError(f"prompt_logprobs_last_n: must be between 1 and len(prompt) - 1 = {len(tokens) - 1}")
    return tokens


def prompt_logprobs(engine: Engine, tokens: list[int], last_n: int | None, top_k: int = 0
                    ) -> tuple[list[float | None], tuple[torch.Tensor, torch.Tensor] | None]:
    """log p(token i | tokens < i) for every prompt token (None for the first, and before the last ``last_n``),
    and with ``top_k``, each position's k likeliest (ids, logprobs), rows without a value left 0 and -99999."""
    with torch.inference_mode():
        ids = torch.tensor([tokens], dtype=torch.long)
        logits = engine.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
        all_lp = torch.log_softmax(logits, dim=-1)
        lp = all_lp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        top = None
        if top_k:
            k = min(top_k, all_lp.shape[-1])
            vals, idx = all_lp.topk(k, dim=-1)
            top_ids = torch.zeros((len(tokens), k), dtype=torch.int32)
            top_lps = torch.full((len(tokens), k), MASK_LOGPROB, dtype=torch.float32)
            first = 1 if last_n is None else len(tokens) - last_n
            top_ids[first:], top_lps[first:] = idx[first - 1:].int(), vals[first - 1:]
            top = (top_ids, top_lps)
    out: list[float | None] = [None, *lp]
    if last_n is not None:
        out = [None] * (len(out) - last_n) + out[len(out) - last_n:]
    return out, top


async def sample(pool: SamplerPool, weights_dir: str, req: wire.Sample, rid: str) -> bytes:
    """Run one asample request; the SampleResponse protobuf."""
    tokens = check_sample(req)
    spec = req.sampling_params
    stop_ids, stop_strings, ignore_eos = _stops(spec)
    max_tokens = DEFAULT_MAX_TOKENS if spec.max_tokens is None else spec.max_tokens
    async with pool.engine(weights_dir) as engine:
        gens = [GenRequest(rid=f"{rid}/{i}", input_ids=list(tokens), temperature=spec.temperature, top_p=spec.top_p,
                           top_k=spec.top_k, max_new_tokens=max_tokens, stop_token_ids=stop_ids,
                           stop_strings=stop_strings, seed=None if spec.seed is None else spec.seed + i,
                           ignore_eos=ignore_eos) for i in range(req.num_samples)]
        try:
            done = await asyncio.gather(*(engine.generate(g) for g in gens))
        except EngineError as exc:
            raise UserError(str(exc)) from None
        want = bool(req.prompt_logprobs) or req.topk_prompt_logprobs > 0
        prompt_lps, top = (await asyncio.to_thread(prompt_logprobs, engine, tokens, req.prompt_logprobs_last_n,
                                                   req.topk_prompt_logprobs) if want else (None, None))
    seqs = []
    for g in done:
        finish = (g.finish or {}).get("type")
        if finish not in ("stop", "length"):
            raise RuntimeError(f"sampling aborted: {(g.finish or {}).get('message', 'unknown reason')}")
        if any(not math.isfinite(x) for x in g.logprobs):
            raise RuntimeError("sampling produced non-finite logprobs")
        seqs.append((list(g.output_ids), list(g.logprobs), finish))
    return wire.encode_sample(seqs, prompt_lps if req.prompt_logprobs else None, top)
