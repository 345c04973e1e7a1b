"""The sampler's fast paths against the full-sort reference (services/inference/sampling.py, §5).

Restricted rows (top-k, top-p) must give the reference's tokens and logprobs for the same seeds,
also where a top-p row falls back to the full sort; unrestricted rows skip the sort and invert in
vocabulary order, so they are checked on the distribution: every token gets the same share of the
uniform interval as in the reference, and seeded draws match the softmax.
"""

from __future__ import annotations

import pytest
import torch

from services.inference import sampling
from services.inference.sampling import sample, sample_sorted


def _gens(seed: int, rows: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1000 + i) for i in range(rows)]


def _logits(seed: int, rows: int, vocab: int, scale: float) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_restricted_and_mixed_rows_match_the_full_sort_reference_token_for_token() -> None:
    rows = 12
    temps = [0.0, 0.7, 1.0, 1.3] * 3
    tops_p = [1.0, 0.9, 0.5, 0.95, 0.99, 1.0] * 2
    tops_k = [-1, 30, 0, 5, -1, 1, 100, 3, 1000, -1, 50, 2]
    checked = 0
    for seed in range(40):
        for vocab, scale in ((264, 3.0), (1000, 0.3), (5, 1.0)):  # peaky, flat (falls back), tiny
            logits = _logits(seed, rows, vocab, scale)
            fast = sample(logits, temps, tops_p, tops_k, _gens(seed, rows))
            ref = sample_sorted(logits, temps, tops_p, tops_k, _gens(seed, rows))
            for i in range(rows):
                if tops_p[i] < 1.0 or 0 < tops_k[i] < vocab or temps[i] == 0.0:
                    assert fast[0][i] == ref[0][i], (seed, vocab, i)
                    assert fast[1][i] == ref[1][i]
                    checked += 1
    assert checked > 1000


def test_top_p_rows_beyond_the_candidates_fall_back_to_the_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    fallbacks: list[int] = []
    full_sort = sampling._draw_sorted

    def counted(logp: torch.Tensor, *args: object) -> torch.Tensor:
        fallbacks.append(logp.shape[0])
        return full_sort(logp, *args)

    vocab = 4 * sampling.CANDIDATES
    logits = _logits(1, 3, vocab, 0.01)  # near uniform (no ties): 64 candidates hold ~1/4 of the mass
    for seed in range(30):
        monkeypatch.setattr(sampling, "_draw_sorted", counted)
        fast, _ = sample(logits, [1.0] * 3, [0.9, 0.2, 0.9], [-1, -1, 10], _gens(seed, 3))
        monkeypatch.setattr(sampling, "_draw_sorted", full_sort)
        ref, _ = sample_sorted(logits, [1.0] * 3, [0.9, 0.2, 0.9], [-1, -1, 10], _gens(seed, 3))
        assert fast == ref
    assert fallbacks == [1] * 30  # only the 0.9 top-p-only row: 0.2 fits in the candidates, top-k 10 too


def test_unrestricted_rows_give_each_token_the_reference_share_of_the_uniform() -> None:
    logits = _logits(7, 1, 264, 2.0)
    logp = torch.log_softmax(logits, dim=-1)
    n = 20_000
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n  # a dense grid of the uniform interval
    rows = logp.expand(n, -1)
    fast = torch.bincount(sampling._draw_unrestricted(rows, u), minlength=264).float() / n
    ref = torch.bincount(sampling._draw_sorted(rows, u, [1.0] * n, [-1] * n), minlength=264).float() / n
    probs = logp.exp()[0]
    assert float((fast - probs).abs().max()) <= 2.0 / n
    assert float((ref - probs).abs().max()) <= 2.0 / n


def test_unrestricted_seeded_draws_follow_the_softmax() -> None:
    vocab, rows, draws = 16, 64, 60
    logits = _logits(3, 1, vocab, 1.5).expand(rows, -1)
    counts = torch.zeros(vocab)
    gens = _gens(5, rows)
    for _ in range(draws):
        toks, lps = sample(logits, [1.0] * rows, [1.0] * rows, [-1] * rows, gens)
        counts += torch.bincount(torch.tensor(toks), minlength=vocab)
        assert lps == torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None]).squeeze(1).tolist()
    freq = counts / counts.sum()
    probs = torch.softmax(logits[0], -1)
    total_variation = 0.5 * float((freq - probs).abs().sum())
    assert total_variation < 0.04, total_variation  # 3840 draws: the expected distance is ~0.02


def test_a_row_draws_one_uniform_per_token_from_its_own_stream() -> None:
    gens, twins = _gens(9, 4), _gens(9, 4)
    assert sampling._uniforms(gens).tolist() == [torch.rand((), generator=g).item() for g in twins]
