"""The embedded engine's prefix cache: finished sequences' KV caches, reused by later prompts.

When a request finishes, the KV cache of its tokens (prompt and output, less the last sampled token,
which was never fed) is kept, keyed by those tokens. A later prompt that starts with the same tokens
(an episode's next turn: the previous prompt, the reply, the new message) takes the longest common
prefix's KV from the store and prefills only the rest. A stored sequence that a newer one extends is
dropped (the newer one serves every lookup the older one would), so one dialogue holds one entry.

Memory is bounded by ``max_bytes``: least recently used entries go first. A weight load clears the
store (``clear``), and only sequences generated wholly on the current weights are stored.

``prefill_inputs`` builds a prefill batch that mixes rows with and without a cached prefix: the
cached KV is left-padded to one width C, the new tokens are left-padded to one width N after it, so
a row's columns are ``[pad, its cache, pad, its new tokens]``; the attention mask hides the pads and
the position ids continue each row's own sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [heads, length, head_dim]


@dataclass
class _Entry:
    tokens: torch.Tensor  # [length] int64, on the CPU
    kv: KV
    nbytes: int
    adapter: str | None  # the LoRA adapter the KV was computed under (None: the base); never shared across


@dataclass
class PrefillInputs:
    """One prefill forward's inputs; ``cached``/``new``: tokens per row taken from the store / fed now."""

    ids: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    cache: DynamicCache
    cached: list[int]
    new: list[int]


class PrefixCache:
    """An LRU store of token sequences' KV caches, bounded in bytes. Used by the engine's worker thread only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self.nbytes = 0
        self.stats = {"hits": 0, "misses": 0, "evicted": 0, "cleared": 0}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget everything (the weights changed: every stored KV is stale)."""
        if self._entries:
            self.stats["cleared"] += 1
        self._entries.clear()
        self.nbytes = 0

    def store(self, tokens: list[int], kv: KV, adapter: str | None = None) -> None:
        """Keep ``kv`` (the KV of exactly ``tokens`` under ``adapter``); drop entries it extends; evict down to
        the bound."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if not self.enabled or not tokens or nbytes > self.max_bytes:
            return
        t = torch.tensor(tokens, dtype=torch.long)
        for key in [k for k, e in self._entries.items()
                    if e.adapter == adapter and len(e.tokens) <= len(t) and _is_prefix(e.tokens, t)]:
            self.nbytes -= self._entries.pop(key).nbytes
        self._entries[self._next] = _Entry(t, kv, nbytes, adapter)
        self._next += 1
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.nbytes -= gone.nbytes
            self.stats["evicted"] += 1

    def lookup(self, tokens: list[int], adapter: str | None = None) -> tuple[int, KV | None]:
        """The longest stored prefix of ``tokens`` under the same ``adapter`` (at most all but the last token:
        its logits are needed) and its KV; ``(0, None)`` when nothing matches."""
        if not self._entries or len(tokens) < 2:
            self.stats["misses"] += 1
            return 0, None
        t = torch.tensor(tokens[:-1], dtype=torch.long)
        best, best_key = 0, -1
        for key, e in self._entries.items():
            n = _common_prefix(e.tokens, t) if e.adapter == adapter else 0
            if n > best:
                best, best_key = n, key
        if best == 0:
            self.stats["misses"] += 1
            return 0, None
        self.stats["hits"] += 1
        self._entries.move_to_end(best_key)
        return best, [(k[:, :best], v[:, :best]) for k, v in self._entries[best_key].kv]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = (a[:m] != b[:m]).nonzero()
    return int(diff[0]) if len(diff) else m


def _is_prefix(a: torch.Tensor, b: torch.Tensor) -> bool:
    return len(a) <= len(b) and bool(torch.equal(a, b[: len(a)]))


def row_kv(cache: DynamicCache, mask: torch.Tensor, row: int) -> KV:
    """Row ``row``'s KV over the columns its mask attends to (copies, independent of the batch)."""
    cols = mask[row].nonzero().squeeze(-1)
    return [(layer.keys[row].index_select(1, cols), layer.values[row].index_select(1, cols)) for layer in cache.layers]


def sequence_tokens(req: Any) -> list[int]:
    """The tokens a finished request's cache holds: its prompt and output less the last (never fed) token."""
    return [*req.input_ids, *req.output_ids[:-1]]


def prefill_inputs(reqs: list[Any], store: PrefixCache, pad_id: int, device: torch.device | str) -> PrefillInputs:
    """The prefill batch of ``reqs``: each row's longest stored prefix comes from ``store``, the rest is fed."""
    found = [store.lookup(r.input_ids, getattr(r, "lora", None)) if store.enabled else (0, None) for r in reqs]
    cached = [n for n, _ in found]
    new = [len(r.input_ids) - n for r, (n, _) in zip(reqs, found, strict=True)]
    c_width, n_width = max(cached), max(new)
    ids = torch.full((len(reqs), n_width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(reqs), c_width + n_width), dtype=torch.long)
    pos = torch.zeros((len(reqs), n_width), dtype=torch.long)
    for i, r in enumerate(reqs):
        c, n = cached[i], new[i]
        ids[i, n_width - n:] = torch.tensor(r.input_ids[c:], dtype=torch.long)
        mask[i, c_width - c:c_width] = 1
        mask[i, c_width + n_width - n:] = 1
        pos[i, n_width - n:] = torch.arange(c, c + n)
    cache = DynamicCache()
    if c_width:
        ref = next(kv for _, kv in found if kv is not None)
        for li in range(len(ref)):
            ks = [_past(kv, ref, li, 0, c_width) for _, kv in found]
            vs = [_past(kv, ref, li, 1, c_width) for _, kv in found]
            cache.update(torch.stack(ks).to(device), torch.stack(vs).to(device), li)
    return PrefillInputs(ids.to(device), mask.to(device), pos.to(device), cache, cached, new)


def _past(kv: KV | None, ref: KV, layer: int, which: int, width: int) -> torch.Tensor:
    """One row's cached keys or values of one layer, left-padded with zeros to ``width`` (all zeros: no cache)."""
    if kv is None:
        t = ref[layer][which]
        return t.new_zeros((t.shape[0], width, t.shape[2]))
    t = kv[layer][which]
    return F.pad(t, (0, 0, width - t.shape[1], 0))
