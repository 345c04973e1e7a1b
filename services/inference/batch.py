"""The running batch of the embedded engine: rows, their shared KV cache, mask and positions.

Rows are left-padded to one cache length. A row's state between steps: the cache holds every
token up to, not including, its last sampled token (``last_tokens``), which the next decode step
feeds at position ``next_pos``. ``join`` merges a freshly prefilled group into the batch (the
shorter cache is left-padded with masked zeros); ``remove`` drops rows, then drops the leading
cache columns that no remaining row attends to, so finished long requests free their space.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = list(cache.layers)
    for layer in layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(f"continuous batching needs plain DynamicLayer caches, got {type(layer).__name__}")
    return layers


class RunningBatch:
    """Not thread-safe by itself: the engine mutates it under its lock or from its worker thread."""

    def __init__(self) -> None:
        self.rows: list[Any] = []
        self.joining: list[Any] = []  # admitted, being prefilled (visible to abort and load)
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        self.next_pos = torch.zeros((0,), dtype=torch.long)
        self.last_tokens = torch.zeros((0,), dtype=torch.long)

    def join(self, rows: list[Any], cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor,
             last_tokens: torch.Tensor) -> None:
        self.joining = []
        if not self.rows or self.cache is None:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            self.next_pos, self.last_tokens = next_pos, last_tokens
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(_layers(self.cache), _layers(cache), strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)], dim=0)
            mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(theirs.values, width)], dim=0)
        self.mask = torch.cat([F.pad(self.mask, (width - self.mask.shape[1], 0)),
                               F.pad(mask, (width - mask.shape[1], 0))], dim=0)
        self.rows += rows
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.last_tokens = torch.cat([self.last_tokens, last_tokens])

    def decode_mask(self) -> torch.Tensor:
        """The attention mask for the next decode step (one more column for the fed token)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        return self.mask

    def advance(self) -> None:
        self.next_pos = self.next_pos + 1

    def remove(self, idx: list[int]) -> list[Any]:
        """Drop rows ``idx``; return them."""
        gone = set(idx)
        left = [r for i, r in enumerate(self.rows) if i in gone]
        keep = [i for i in range(len(self.rows)) if i not in gone]
        if not keep or self.cache is None:
            self.__init__()  # type: ignore[misc]
            return left
        sel = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[i] for i in keep]
        self.mask, self.next_pos, self.last_tokens = self.mask[sel], self.next_pos[sel], self.last_tokens[sel]
        used = self.mask.sum(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, start:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys[sel, :, start:]
            layer.values = layer.values[sel, :, start:]
        return left


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """[n, heads, L, d] -> [n, heads, width, d], zeros on the left of the sequence axis."""
    return F.pad(t, (0, 0, width - t.shape[2], 0))
