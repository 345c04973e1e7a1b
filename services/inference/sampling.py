"""The one token sampler: the embedded engine and every in-process player draw through ``sample``.

SGLang's conventions. A temperature below ``GREEDY_BELOW`` (1e-6) means greedy (argmax), and the
logprob reported for it is that of T = 1. Otherwise the logprob of the drawn token is
``log_softmax(logits / T)[token]`` in float32, as the trainer's full-sequence forward computes
it: top-k (``<= 0``: off) and top-p only restrict what may be drawn, they do not renormalise the
reported logprob. A row draws one uniform number from its own ``torch.Generator`` per token (also
a greedy row, when other rows of the batch sample), then inverts the cumulative distribution of
the kept tokens, so the same seed gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GREEDY_BELOW = 1e-6


def sample(logits: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float], top_k: Sequence[int],
           generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits`` [rows, vocab]; return (token ids, their logprobs).

    The per-row sequences hold each row's temperature, top-p, top-k and generator (None: torch's
    global one)."""
    logits = logits.float()
    greedy = torch.tensor([t < GREEDY_BELOW for t in temperature])
    temps = torch.tensor([t if t >= GREEDY_BELOW else 1.0 for t in temperature])
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tok = logp.argmax(dim=-1)
    if not bool(greedy.all()):
        vocab = logp.shape[-1]
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        ks = torch.tensor([k if k > 0 else vocab for k in top_k])
        keep = torch.arange(vocab)[None, :] < ks[:, None]
        keep &= (probs.cumsum(dim=-1) - probs) < torch.tensor(list(top_p), dtype=probs.dtype)[:, None]
        cdf = (probs * keep).cumsum(dim=-1)
        u = torch.stack([torch.rand((), generator=g) for g in generators]) * cdf[:, -1]
        idx = torch.searchsorted(cdf, u[:, None].contiguous(), right=True)
        idx = torch.minimum(idx, keep.sum(dim=-1, keepdim=True) - 1)
        tok = torch.where(greedy, tok, order.gather(1, idx).squeeze(1))
    lp = logp.gather(1, tok[:, None]).squeeze(1)
    return tok.tolist(), lp.tolist()
