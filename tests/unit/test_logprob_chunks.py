"""Token logprobs and entropy in row chunks (services/training/grpo.py; docs/architecture.md §3): every row is
computed exactly as without chunks, values and gradients, and a chunked pass keeps one chunk's float32 work."""

from __future__ import annotations

import pytest
import torch

from services.training.grpo import token_entropy, token_logprobs


def logits_and_targets(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).to(dtype)
    return logits, torch.randint(0, 50, (3, 7), generator=g)


@pytest.mark.parametrize("chunk", [50, 120, 500])  # one row a chunk, rows that straddle a batch row, several rows
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_give_the_same_values_and_gradients(chunk: int, temperature: float) -> None:
    logits, targets = logits_and_targets()
    whole = logits.clone().requires_grad_(True)
    parts = logits.clone().requires_grad_(True)
    lp_w, ent_w = token_logprobs(whole, targets, temperature), token_entropy(whole, temperature)
    lp_c = token_logprobs(parts, targets, temperature, chunk_logits=chunk)
    ent_c = token_entropy(parts, temperature, chunk_logits=chunk)
    assert torch.equal(lp_w, lp_c) and torch.equal(ent_w, ent_c) and lp_c.shape == targets.shape
    weights = torch.linspace(-1, 1, targets.numel()).view(targets.shape)
    ((lp_w * weights).sum() + ent_w.sum()).backward()
    ((lp_c * weights).sum() + ent_c.sum()).backward()
    assert torch.allclose(whole.grad, parts.grad, rtol=0, atol=1e-6)


def test_chunks_without_grad_and_in_bfloat16() -> None:
    logits, targets = logits_and_targets(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(token_logprobs(logits, targets, 1.0), token_logprobs(logits, targets, 1.0, chunk_logits=64))
        assert token_logprobs(logits, targets, 1.0, chunk_logits=64).dtype == torch.float32


def test_bfloat16_logits_get_bfloat16_gradients_close_to_the_whole_pass() -> None:
    logits, targets = logits_and_targets(torch.bfloat16)
    whole, parts = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    token_logprobs(whole, targets, 0.7).sum().backward()
    token_logprobs(parts, targets, 0.7, chunk_logits=64).sum().backward()
    assert parts.grad.dtype == torch.bfloat16
    assert torch.allclose(whole.grad.float(), parts.grad.float(), rtol=0, atol=1e-2)


def test_the_trainers_shifted_view_is_chunked_without_a_copy_and_gets_its_gradient() -> None:
    logits, targets = logits_and_targets()
    whole, parts = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    token_logprobs(whole[:, :-1], targets[:, 1:], 1.0).sum().backward()
    lp = token_logprobs(parts[:, :-1], targets[:, 1:], 1.0, chunk_logits=100)
    with torch.no_grad():
        assert torch.equal(token_entropy(parts[:, :-1], 1.0, chunk_logits=100), token_entropy(whole[:, :-1], 1.0))
    lp.sum().backward()
    assert torch.allclose(whole.grad, parts.grad, rtol=0, atol=1e-6) and not parts.grad[:, -1].any()
