"""forward_backward runs chunk by chunk: same outputs and gradients as one whole batch, bounded autograd memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.demo.tiny_model import create_tiny_model
from services.tinker_api.lora_host import BaseHost, Datum, LoraClient, chunks
from services.tinker_api.losses import BuiltinLoss, UserError

LOSSES = [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}), ("cispo", {}), ("dro", {"beta": 0.05}),
          ("gspo", {})]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> LoraClient:
    model = create_tiny_model(tmp_path_factory.mktemp("m") / "model", seed=0, hidden=64, layers=2)
    return LoraClient(BaseHost(str(model)), "c", rank=4, seed=0, mlp=True, attn=True, unembed=False)


def batch(n: int, vocab: int, seed: int = 0) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 5 + (i * 7) % 13
        tokens = torch.randint(1, vocab, (t,), generator=g)
        inputs = {"target_tokens": torch.randint(1, vocab, (t,), generator=g), "weights": torch.rand(t, generator=g),
                  "logprobs": -torch.rand(t, generator=g) * 3, "advantages": torch.randn(t, generator=g)}
        out.append(Datum(tokens.tolist(), inputs))
    return out


def run(client: LoraClient, data: list[Datum], loss: Any, budget: int) -> tuple[Any, list[torch.Tensor]]:
    client.logit_budget = budget
    for p in client.params:
        p.grad = None
    out = client.forward_backward(data, loss, backward=True)
    return out, [p.grad.clone() for p in client.params]  # type: ignore[union-attr]


def test_chunks_keep_order_and_stay_within_the_budget() -> None:
    assert chunks([3, 3, 3, 10, 2], 9) == [[0, 1, 2], [3], [4]]
    assert chunks([4, 1, 1], 8) == [[0, 1], [2]]


@pytest.mark.parametrize(("loss_fn", "cfg"), LOSSES)
def test_per_datum_chunks_match_one_whole_batch(client: LoraClient, loss_fn: str, cfg: dict[str, float]) -> None:
    vocab = int(client.host.config.vocab_size)
    data = batch(12, vocab)
    (lp_all, total_all, m_all), g_all = run(client, data, BuiltinLoss(loss_fn, cfg), 10**12)
    (lp_one, total_one, m_one), g_one = run(client, data, BuiltinLoss(loss_fn, cfg), vocab)  # one datum a chunk
    assert m_all == m_one
    assert [x.shape for x in lp_all] == [x.shape for x in lp_one]
    for a, b in zip(lp_all, lp_one, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert total_one == pytest.approx(total_all, rel=1e-5, abs=1e-5)
    for a, b in zip(g_all, g_one, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in g_one)


def peak_saved_bytes(client: LoraClient, data: list[Datum], budget: int) -> int:
    """The most bytes autograd holds for backward at once during the call (logits and activations)."""
    live, peak = [0], [0]

    class Held:
        def __init__(self, t: torch.Tensor) -> None:
            self.t, self.n = t, t.numel() * t.element_size()
            live[0] += self.n
            peak[0] = max(peak[0], live[0])

        def __del__(self) -> None:
            live[0] -= self.n

    client.logit_budget = budget
    with torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t):
        client.forward_backward(data, BuiltinLoss("cross_entropy", {}), backward=True)
    return peak[0]


def test_peak_memory_no_longer_grows_with_the_number_of_data(client: LoraClient) -> None:
    vocab = int(client.host.config.vocab_size)
    budget = vocab * 20  # room for one datum (up to 17 tokens) per chunk
    small, large = batch(4, vocab), batch(32, vocab)
    assert peak_saved_bytes(client, large, budget) < 1.5 * peak_saved_bytes(client, small, budget)  # longest 17 vs 13
    whole_small, whole_large = peak_saved_bytes(client, small, 10**12), peak_saved_bytes(client, large, 10**12)
    assert whole_large > 4 * whole_small  # the whole-batch path grows with the data
    assert peak_saved_bytes(client, large, budget) * 4 < whole_large


class FailsLate(BuiltinLoss):
    """cross_entropy that refuses a datum with a negative weight, as a user's loss may fail on its data."""

    def __call__(self, logp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> Any:
        if bool((inputs["weights"] < 0).any()):
            raise UserError("negative weight")
        return super().__call__(logp, inputs)


def test_a_call_failing_in_a_later_chunk_leaves_the_gradients_it_found(client: LoraClient) -> None:
    vocab = int(client.host.config.vocab_size)
    data = batch(6, vocab)
    _, before = run(client, data[:2], BuiltinLoss("cross_entropy", {}), vocab)
    data[4].inputs["weights"] = -data[4].inputs["weights"]
    with pytest.raises(UserError):
        client.forward_backward(data, FailsLate("cross_entropy", {}), backward=True)
    for p, g in zip(client.params, before, strict=True):
        assert p.grad is not None and torch.equal(p.grad, g)
