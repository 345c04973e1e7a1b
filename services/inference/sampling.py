"""The one token sampler: the embedded engine and every in-process player draw through ``sample``.

SGLang's conventions (docs/architecture.md §5, the embedded engine). A temperature below
``GREEDY_BELOW`` (1e-6) means greedy (argmax), and the logprob reported for it is that of T = 1.
Otherwise the logprob of the drawn token is ``log_softmax(logits / T)[token]`` in float32, as the
trainer's full-sequence forward computes it: top-k (``<= 0``: off) and top-p only restrict what may
be drawn, they do not renormalise the reported logprob. A row draws one uniform number ``u`` from
its own ``torch.Generator`` per token (also a greedy row, when other rows of the batch sample),
then inverts the cumulative distribution of the kept tokens at ``u`` times their mass, so the same
seed gives the same tokens whatever else is in the batch.

Three paths, one distribution (``sample_sorted`` is the reference: a full descending sort of the
vocabulary, then top-k, top-p and the inversion in sorted order):

- greedy rows: argmax, no sort;
- unrestricted rows (top-p >= 1, top-k off or >= the vocabulary): no sort; the cumulative
  distribution is inverted in vocabulary order. Each token keeps exactly its probability, but a
  given ``u`` maps to another token than in sorted order, so a seed's tokens differ from the
  reference's (the distribution does not). The reference's top-p of exactly 1 can also drop tail
  tokens whose float cumulative sum before them already rounds to 1 (mass below ~1e-7); this path
  keeps them;
- restricted rows: ``torch.topk`` on a bounded candidate set (the largest top-k, or
  ``CANDIDATES`` when a row has only top-p), then the reference's rule on those candidates. The
  candidates are the sorted prefix, so tokens and logprobs are those of the reference for the same
  ``u``; a top-p row whose candidates hold less than top-p (plus a margin for rounding) falls back
  to the full sort. Ties in the logits may be ordered differently by topk and sort (both orders
  are arbitrary).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GREEDY_BELOW = 1e-6
CANDIDATES = 64  # candidate set for a top-p-only row before falling back to the full sort
TOP_P_MARGIN = 1e-4  # candidates must hold top_p + this, so float rounding cannot change the kept set


def sample(logits: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float], top_k: Sequence[int],
           generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits`` [rows, vocab]; return (token ids, their logprobs).

    The per-row sequences hold each row's temperature, top-p, top-k and generator (None: torch's
    global one)."""
    logp, greedy = _logprobs(logits, temperature)
    tok = logp.argmax(dim=-1)
    if not all(greedy):
        vocab = logp.shape[-1]
        u = _uniforms(generators).to(logp.device)
        ks = [k if 0 < k < vocab else 0 for k in top_k]
        free = [i for i, g in enumerate(greedy) if not g and ks[i] == 0 and top_p[i] >= 1.0]
        limited = [i for i, g in enumerate(greedy) if not g and (ks[i] > 0 or top_p[i] < 1.0)]
        if free:
            _put(tok, free, _draw_unrestricted(_rows(logp, free), _rows(u, free)))
        if limited:
            _put(tok, limited, _draw_candidates(_rows(logp, limited), _rows(u, limited),
                                                [top_p[i] for i in limited], [ks[i] for i in limited]))
    lp = logp.gather(1, tok[:, None]).squeeze(1)
    return tok.tolist(), lp.tolist()


def sample_sorted(logits: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float], top_k: Sequence[int],
                  generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """The reference: ``sample``'s semantics through a full sort of every sampling row."""
    logp, greedy = _logprobs(logits, temperature)
    tok = logp.argmax(dim=-1)
    if not all(greedy):
        drawn = _draw_sorted(logp, _uniforms(generators).to(logp.device), list(top_p), list(top_k))
        tok = torch.where(torch.tensor(greedy, device=logp.device), tok, drawn)
    lp = logp.gather(1, tok[:, None]).squeeze(1)
    return tok.tolist(), lp.tolist()


def _logprobs(logits: torch.Tensor, temperature: Sequence[float]) -> tuple[torch.Tensor, list[bool]]:
    greedy = [t < GREEDY_BELOW for t in temperature]
    logits = logits.float()
    if all(t == 1.0 or g for t, g in zip(temperature, greedy, strict=True)):
        return torch.log_softmax(logits, dim=-1), greedy
    temps = torch.tensor([1.0 if g else t for t, g in zip(temperature, greedy, strict=True)], device=logits.device)
    return torch.log_softmax(logits / temps[:, None], dim=-1), greedy


def _uniforms(generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One uniform per row from the row's generator (the same stream as ``torch.rand((), generator=g)``)."""
    u = torch.empty(len(generators))
    for cell, gen in zip(u.unbind(0), generators, strict=True):
        cell.uniform_(generator=gen)
    return u


def _rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    return t if len(idx) == t.shape[0] else t[torch.tensor(idx, device=t.device)]


def _put(tok: torch.Tensor, idx: list[int], values: torch.Tensor) -> None:
    if len(idx) == tok.shape[0]:
        tok.copy_(values)
    else:
        tok[torch.tensor(idx, device=tok.device)] = values


def _invert(cdf: torch.Tensor, u: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds ``u`` times the row's kept mass."""
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].contiguous(), right=True)
    return torch.minimum(idx, kept - 1)


def _draw_unrestricted(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Every token may be drawn: invert the cumulative distribution in vocabulary order, no sort."""
    cdf = logp.exp().cumsum(dim=-1)
    kept = torch.full((logp.shape[0], 1), logp.shape[1], dtype=torch.long, device=logp.device)
    return _invert(cdf, u, kept).squeeze(1)


def _keep(probs: torch.Tensor, top_p: Sequence[float], ks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's kept mask over sorted probabilities, and their inclusive cumulative sum."""
    width = probs.shape[-1]
    cum = probs.cumsum(dim=-1)
    dev = probs.device
    limit = torch.tensor([k if k > 0 else width for k in ks], device=dev)
    keep = torch.arange(width, device=dev)[None, :] < limit[:, None]
    keep &= (cum - probs) < torch.tensor(list(top_p), dtype=probs.dtype, device=dev)[:, None]
    return keep, cum


def _draw_candidates(logp: torch.Tensor, u: torch.Tensor, top_p: list[float], ks: list[int]) -> torch.Tensor:
    """Top-k and/or top-p rows: the reference's draw on a ``torch.topk`` prefix, exact when it suffices."""
    vocab = logp.shape[-1]
    width = min(vocab, max(max(ks), CANDIDATES if min(ks) == 0 else 0))
    top_lp, order = logp.topk(width, dim=-1, sorted=True)
    probs = top_lp.exp()
    keep, cum = _keep(probs, top_p, ks)
    cdf = (probs * keep).cumsum(dim=-1)
    tok = order.gather(1, _invert(cdf, u, keep.sum(dim=-1, keepdim=True))).squeeze(1)
    if width < vocab:
        top_p_only = torch.tensor([k == 0 for k in ks], device=logp.device)
        room = torch.tensor(top_p, device=logp.device) + TOP_P_MARGIN
        short = (top_p_only & (cum[:, -1] < room)).nonzero().flatten().tolist()
        if short:  # the kept set may reach past the candidates: the full sort for these rows
            _put(tok, short, _draw_sorted(_rows(logp, short), _rows(u, short),
                                          [top_p[i] for i in short], [0] * len(short)))
    return tok


def _draw_sorted(logp: torch.Tensor, u: torch.Tensor, top_p: list[float], top_k: list[int]) -> torch.Tensor:
    """The reference draw: sort the whole vocabulary, keep top-k and top-p, invert in sorted order."""
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_lp.exp()
    keep, _ = _keep(probs, top_p, [k if k > 0 else 0 for k in top_k])
    cdf = (probs * keep).cumsum(dim=-1)
    return order.gather(1, _invert(cdf, u, keep.sum(dim=-1, keepdim=True))).squeeze(1)
