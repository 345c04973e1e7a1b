"""Fixed weights played in-process: opponent-pool versions and ``tandem eval`` checkpoints.

A player ``policy:<dir>`` is an HF model directory loaded here with
transformers (a few kept in memory, least recently used dropped) and sampled
with the request's sampling parameters in a worker thread, so the event loop
never blocks. Its replies look like an engine's (ids, logprobs), but nothing
it generates is trained on.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import OrderedDict
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from services.contracts.messages import GenerateReply, GenerateRequest

POLICY = "policy:"


def context_length(model_path: str) -> int:
    """A model's context window (a prompt that reaches it ends the episode as truncated)."""
    cfg = AutoConfig.from_pretrained(model_path)
    return int(getattr(cfg, "max_position_embeddings", None) or 1 << 62)


class LocalPolicies:
    def __init__(self, max_models: int = 4) -> None:
        self.max_models = max_models
        self.models: OrderedDict[str, Any] = OrderedDict()
        self.tokenizers: dict[str, Any] = {}
        self.lock = threading.Lock()  # one forward at a time: torch threads are shared anyway

    def tokenizer(self, path: str) -> Any:
        if path not in self.tokenizers:
            self.tokenizers[path] = AutoTokenizer.from_pretrained(path)
        return self.tokenizers[path]

    def _model(self, path: str) -> Any:
        if path in self.models:
            self.models.move_to_end(path)
            return self.models[path]
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        self.models[path] = model
        while len(self.models) > self.max_models:
            self.models.popitem(last=False)
        return model

    def _generate(self, path: str, req: GenerateRequest) -> tuple[list[int], list[float], str]:
        sp = req.sampling
        tok = self.tokenizer(path)
        stop = {tok.eos_token_id, *sp.stop_token_ids}
        with self.lock, torch.no_grad():
            model = self._model(path)
            gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else random.getrandbits(63))
            ids = torch.tensor([req.input_ids])
            out = model(ids, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
            output_ids: list[int] = []
            logprobs: list[float] = []
            finish = "length"
            for _ in range(sp.max_new_tokens):
                logp = torch.log_softmax(logits / max(sp.temperature, 1e-6), -1)
                if sp.temperature == 0:
                    nxt = int(torch.argmax(logp))
                else:
                    probs = logp.exp()
                    if sp.top_k > 0:
                        probs[probs < torch.topk(probs, min(sp.top_k, probs.numel())).values[-1]] = 0
                    nxt = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
                output_ids.append(nxt)
                logprobs.append(float(logp[nxt]))
                if nxt in stop:
                    finish = "stop"
                    break
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1]
        return output_ids, logprobs, finish

    async def generate(self, req: GenerateRequest) -> GenerateReply:
        path = req.agent[len(POLICY):]
        ids, lps, finish = await asyncio.to_thread(self._generate, path, req)
        return GenerateReply(request_id=req.id, agent=req.agent, episode_id=req.episode_id, turn=req.turn,
                             output_ids=ids, output_logprobs=lps, finish_reason=finish,  # type: ignore[arg-type]
                             weight_version=-1, engine=f"local:{path}", prompt_tokens=len(req.input_ids))
