"""The custom-loss checker in process: graphs the tinker 0.38 SDK traces and encodes are rebuilt and run as the
function itself runs; anything outside the server's op set is a UserError naming what it refuses."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from services.tinker_api.custom_loss import CustomLoss
from services.tinker_api.losses import UserError


def encoded(fn: Any, ranks: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    handle = trace_loss(fn, ranks, "s")
    return [x.model_dump() for x in handle.inputs], encode_graph(handle).model_dump(mode="json")


def topk_margin(logprobs, mask, scale):
    """[T, K] logprobs, a [T] mask, a scalar: slicing, shape reads, dtypes, kwargs and inf constants."""
    best = logprobs[:, 0]
    rest = torch.logsumexp(logprobs[:, 1:], dim=-1)
    margin = torch.clamp(best - rest, min=float("-inf"), max=5.0) * mask.to(torch.float32)
    loss = -(margin.sum() * scale) / logprobs.shape[0]
    return loss, {"custom/margin:mean": margin.mean(), "custom/tokens:sum": mask.sum(dtype=torch.float32)}


def test_a_traced_loss_runs_as_the_function_does():
    inputs, graph = encoded(topk_margin, {"logprobs": 2, "mask": 1, "scale": 0})
    loss_fn = CustomLoss("topk_margin", inputs, graph)
    lp = torch.randn(6, 3, requires_grad=True)
    data = {"mask": torch.tensor([1, 0, 1, 1, 0, 1]), "scale": torch.tensor(0.5),
            "target_tokens": torch.zeros(6, 3, dtype=torch.long)}
    loss, metrics = loss_fn(lp, data)
    want, want_metrics = topk_margin(lp, data["mask"], data["scale"])
    assert torch.equal(loss, want) and metrics.keys() == want_metrics.keys()
    loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    assert loss_fn.metrics([metrics, metrics]) == pytest.approx(
        {"custom/margin:mean": float(want_metrics["custom/margin:mean"]), "custom/tokens:sum": 8.0})
    loss_fn.check_datum(0, 6, data)
    with pytest.raises(UserError, match="rank"):
        loss_fn.check_datum(0, 6, {**data, "mask": torch.ones(6, 2)})


def plain(logprobs, adv):
    loss = -(logprobs * adv).sum()
    return loss, {"custom/loss:sum": loss}


def edited(change: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    inputs, graph = encoded(plain, {"logprobs": 1, "adv": 1})
    inputs, graph = copy.deepcopy(inputs), copy.deepcopy(graph)
    change(inputs, graph["nodes"])
    return inputs, graph


@pytest.mark.parametrize(("change", "what"), [
    (lambda i, n: n[2].update(target="torch.load"), "'torch.load' is not a function"),
    (lambda i, n: n[2].update(op="call_method", target="register_hook"), "'register_hook'"),
    (lambda i, n: n[2].update(op="call_module", target="lin"), "call_module"),
    (lambda i, n: n[2].update(target="getattr", args=[{"ref": "logprobs"}, "grad"]), "getattr may read only"),
    (lambda i, n: n[2]["args"].append({"device": "cuda"}), "device constants are refused"),
    (lambda i, n: n[2]["args"].append({"pickle": "x"}), "not an encoding"),
    (lambda i, n: n[2]["args"].__setitem__(0, {"ref": "output"}), "not an earlier node"),
    (lambda i, n: i.reverse(), "first input of a custom loss is logprobs"),
    (lambda i, n: i[1].update(name="other"), "must be the inputs"),
    (lambda i, n: n[-1]["args"][0]["tuple"][1]["dict"].update({"loss": {"ref": "neg"}}), "metric 'loss'"),
    (lambda i, n: n.pop(), "exactly one output node"),
])
def test_graphs_outside_the_op_set_are_refused(change: Any, what: str):
    inputs, graph = edited(change)
    with pytest.raises(UserError, match=what.replace("(", r"\(")):
        CustomLoss("plain", inputs, graph)


def test_python_values_cannot_blow_up():
    def bomb(inputs: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> None:
        nodes.insert(2, {"op": "call_function", "name": "big", "target": "operator.mul", "args": ["x", 10 ** 12]})

    loss_fn = CustomLoss("plain", *edited(bomb))
    with pytest.raises(UserError, match="strings or sequences"):
        loss_fn(torch.zeros(3, requires_grad=True), {"adv": torch.ones(3)})
