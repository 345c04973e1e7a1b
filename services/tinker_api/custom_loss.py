"""Server-side custom losses: a traced loss graph checked against an allowed op set, then run per datum.

``ServiceClient.create_custom_loss`` (tinker 0.38) traces the user's function with torch.fx
and sends its nodes as plain data (``CustomLossGraph``). Nothing in it is executable until
this module rebuilds it, node by node, from its own lists: ``FUNCTIONS`` (torch, math and
operator functions), ``METHODS`` (tensor methods) and ``ATTRIBUTES`` (what ``getattr`` may
read). The SDK's own rules hold too: no ``get_attr`` (captured tensors) or ``call_module``
nodes, no ``backward``/``item``/``numpy``/``tolist``, ``logprobs`` first, and an output of
``(loss, metrics)`` with metrics keyed ``custom/<name>:sum`` or ``:mean``. Anything else is a
UserError naming the node. The loss runs once per datum; losses are summed and metrics
reduce by their suffix, as the SDK's client-side path does.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.tinker_api.losses import UserError

MAX_INPUTS, MAX_NODES = 16, 2000
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "getitem", "lt",
              "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor", "invert", "matmul")
_TORCH = ("exp", "log", "log1p", "expm1", "exp2", "log2", "log10", "sigmoid", "tanh", "softmax", "log_softmax",
          "logsumexp", "sum", "mean", "prod", "max", "min", "amax", "amin", "clamp", "clip", "minimum", "maximum",
          "where", "abs", "sqrt", "rsqrt", "square", "pow", "neg", "sign", "relu", "ones_like", "zeros_like",
          "full_like", "stack", "cat", "gather", "masked_fill", "cumsum", "flip", "std", "var", "norm", "any",
          "all", "logical_and", "logical_or", "logical_not", "isfinite", "nan_to_num", "detach", "reshape",
          "flatten", "squeeze", "unsqueeze", "transpose", "matmul", "dot", "add", "sub", "mul", "div",
          "lt", "le", "gt", "ge", "eq", "ne", "float_power", "lerp", "numel", "count_nonzero")
_FUNCTIONAL = ("relu", "softplus", "logsigmoid", "log_softmax", "softmax", "silu", "gelu", "kl_div", "mse_loss",
               "l1_loss", "smooth_l1_loss", "normalize")
_MATH = ("exp", "log", "log1p", "expm1", "sqrt", "tanh", "fabs", "floor", "ceil", "isfinite", "pow")
FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{f"operator.{n}": getattr(operator, n) for n in _OPERATORS},
    **{f"torch.{n}": getattr(torch, n) for n in _TORCH},
    **{f"torch.nn.functional.{n}": getattr(F, n) for n in _FUNCTIONAL},
    **{f"math.{n}": getattr(math, n) for n in _MATH},
    "getattr": getattr,  # how fx names the builtin (x.shape)
}
METHODS = frozenset({
    *(n for n in _TORCH if n not in ("ones_like", "zeros_like", "full_like", "stack", "cat")),
    "clamp_min", "clamp_max", "float", "double", "long", "int", "bool", "to", "type_as", "view", "view_as",
    "expand_as", "t", "permute", "size", "dim", "contiguous", "clone", "sub", "add", "mul", "div",
    "rsub", "reciprocal", "nansum", "argmax", "argmin", "masked_fill", "unbind", "split", "chunk"})
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T", "mT"})
_CONSTANTS = {"dtype": {n: getattr(torch, n) for n in ("float32", "float64", "float16", "bfloat16", "int64",
                                                        "int32", "bool")},
              "layout": {"strided": torch.strided}, "memory_format": {"contiguous_format": torch.contiguous_format,
                                                                      "preserve_format": torch.preserve_format}}
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


@dataclass(frozen=True)
class Node:
    op: str
    name: str
    target: str
    args: list[Any]
    kwargs: dict[str, Any]


class CustomLoss:
    """A checked loss graph: ``inputs`` is ((name, rank), ...), ``logprobs`` first."""

    def __init__(self, name: str, inputs: list[dict[str, Any]], graph: dict[str, Any]) -> None:
        self.name = name
        self.inputs = _check_inputs(inputs)
        self.nodes = _check_graph(self.inputs, graph)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.inputs[1:])

    def check_datum(self, index: int, n_tokens: int, inputs: dict[str, torch.Tensor]) -> None:
        """The datum has every input the loss reads, at its declared rank (``logprobs``: target_tokens')."""
        pairs = [("target_tokens", self.inputs[0][1]), *((n, r) for n, r in self.inputs[1:])]
        for key, rank in pairs:
            if key not in inputs:
                raise UserError(f"data[{index}].loss_fn_inputs: loss {self.name!r} needs {key!r}")
            if inputs[key].dim() != rank:
                raise UserError(f"data[{index}].loss_fn_inputs.{key}: rank {inputs[key].dim()}, loss {self.name!r} "
                                f"declared rank {rank}")
        if inputs["target_tokens"].shape[0] != n_tokens:
            raise UserError(f"data[{index}].loss_fn_inputs.target_tokens: shape {list(inputs['target_tokens'].shape)} "
                            f"does not align with model_input's {n_tokens} tokens")

    def metrics(self, per_datum: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        return reduce_metrics(per_datum)

    def __call__(self, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        env: dict[str, Any] = {}
        args = iter([logprobs, *(inputs[n] for n in self.input_names)])
        for node in self.nodes:
            if node.op == "placeholder":
                env[node.name] = next(args)
                continue
            a, kw = _decode(node.args, env), {k: _decode(v, env) for k, v in node.kwargs.items()}
            if node.op == "output":
                loss, metrics = a[0]
                break
            env[node.name] = _run(node, a, kw)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise UserError(f"loss {self.name!r} must return a scalar tensor loss, got "
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        return loss, metrics


def _run(node: Node, args: list[Any], kwargs: dict[str, Any]) -> Any:
    try:
        if node.op == "call_function":
            _check_python_args(node.target, args)
            return FUNCTIONS[node.target](*args, **kwargs)
        if not isinstance(args[0], torch.Tensor):
            raise TypeError(f"{node.target}() is called on a {type(args[0]).__name__}, not a tensor")
        if node.target == "to" and any(not isinstance(x, torch.dtype) for x in [*args[1:], *kwargs.values()]):
            raise TypeError("to() may only change the dtype here")
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a loss that fails on this data is the user's error
        raise UserError(f"custom loss node {node.name} ({node.target}): {type(exc).__name__}: {exc}") from None


def _check_python_args(target: str, args: list[Any]) -> None:
    """No arithmetic on Python sequences or strings (``"x" * 10**12``), no huge integer powers."""
    if not target.startswith(("operator.", "math.")) or target == "operator.getitem":
        return
    if any(isinstance(a, str | list | tuple | bytes) for a in args):
        raise TypeError(f"{target} on Python strings or sequences is refused")
    if target.endswith("pow") and len(args) == 2 and all(isinstance(a, int) for a in args) and abs(args[1]) > 64:
        raise TypeError("integer powers above 64 are refused")


def reduce_metrics(per_datum: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Sum each metric over the datums; a ``:mean`` metric is then divided by their number."""
    sums: dict[str, float] = {}
    for metrics in per_datum:
        for key, value in metrics.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise UserError(f"custom loss metric {key!r} must be a scalar tensor, got {got}")
            sums[key] = sums.get(key, 0.0) + float(value.detach().float().reshape(-1)[0])
    return {k: v / len(per_datum) if k.endswith(":mean") else v for k, v in sums.items()}


def _check_inputs(inputs: list[dict[str, Any]]) -> tuple[tuple[str, int], ...]:
    pairs = tuple((str(x.get("name")), x.get("rank")) for x in inputs)
    if not pairs or pairs[0][0] != "logprobs":
        raise UserError("inputs: the first input of a custom loss is logprobs")
    if len(pairs) > MAX_INPUTS:
        raise UserError(f"inputs: a custom loss takes at most {MAX_INPUTS} inputs, logprobs included")
    if pairs[0][1] not in (1, 2):
        raise UserError("inputs: logprobs has rank 1 ([T]) or 2 ([T, K])")
    for name, rank in pairs:
        if not _INPUT_NAME.fullmatch(name) or rank not in (0, 1, 2):
            raise UserError(f"inputs: {name!r} with rank {rank!r}: a lowercase name and a rank of 0, 1 or 2")
    if len({n for n, _ in pairs}) != len(pairs):
        raise UserError("inputs: names repeat")
    return tuple((n, int(r)) for n, r in pairs)


def _check_graph(inputs: tuple[tuple[str, int], ...], graph: dict[str, Any]) -> list[Node]:
    if graph.get("format", 1) != 1:
        raise UserError(f"graph.format: {graph.get('format')!r} is not a format this server reads (1)")
    raw = graph.get("nodes")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_NODES:
        raise UserError(f"graph.nodes: a list of 1 to {MAX_NODES} nodes")
    nodes = [Node(str(n.get("op")), str(n.get("name")), str(n.get("target")), list(n.get("args") or []),
                  dict(n.get("kwargs") or {})) for n in raw]
    placeholders = [n.target for n in nodes if n.op == "placeholder"]
    if placeholders != [n for n, _ in inputs] or any(n.op == "placeholder" for n in nodes[len(inputs):]):
        raise UserError(f"graph: its parameters {placeholders} must be the inputs {[n for n, _ in inputs]}, first")
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        where = f"graph.nodes[{i}] ({node.name})"
        if node.name in seen or not node.name:
            raise UserError(f"{where}: node names must be unique and non-empty")
        _check_node(where, node)
        _check_value(where, [node.args, *node.kwargs.values()], seen)
        seen.add(node.name)
    if nodes[-1].op != "output" or sum(n.op == "output" for n in nodes) != 1:
        raise UserError("graph: exactly one output node, the last")
    _check_output(nodes[-1])
    return nodes


def _check_node(where: str, node: Node) -> None:
    if node.op in ("placeholder", "output"):
        return
    if node.op == "call_function":
        if node.target not in FUNCTIONS:
            raise UserError(f"{where}: {node.target!r} is not a function custom losses may call here")
        if node.target == "getattr" and (len(node.args) != 2 or node.args[1] not in ATTRIBUTES):
            raise UserError(f"{where}: getattr may read only {sorted(ATTRIBUTES)}")
        return
    if node.op == "call_method":
        if node.target not in METHODS:
            raise UserError(f"{where}: tensor method {node.target!r} is not one custom losses may call here")
        return
    if node.op in ("get_attr", "call_module"):
        raise UserError(f"{where}: {node.op} nodes are refused (no captured tensors, no torch.nn modules)")
    raise UserError(f"{where}: unknown op {node.op!r}")


def _check_value(where: str, value: Any, seen: set[str]) -> None:
    """An encoded argument: JSON scalars, lists, and one-key objects naming an earlier node or a known constant."""
    if isinstance(value, list):
        for v in value:
            _check_value(where, v, seen)
        return
    if value is None or isinstance(value, bool | int | float | str):
        return
    if not (isinstance(value, dict) and len(value) == 1):
        raise UserError(f"{where}: argument {value!r} is not an encoding this server reads")
    (kind, inner), = value.items()
    if kind == "ref" and inner not in seen:
        raise UserError(f"{where}: refers to {inner!r}, which is not an earlier node")
    if kind in ("tuple", "slice") and isinstance(inner, list) and (kind == "tuple" or len(inner) == 3):
        _check_value(where, inner, seen)
    elif kind == "dict" and isinstance(inner, dict):
        _check_value(where, list(inner.values()), seen)
    elif kind in _CONSTANTS and inner not in _CONSTANTS[kind]:
        raise UserError(f"{where}: {kind} {inner!r} is not accepted here")
    elif kind == "float" and inner not in _FLOATS:
        raise UserError(f"{where}: float {inner!r} is not inf, -inf or nan")
    elif kind not in ("ref", "ellipsis", "float", *_CONSTANTS):
        raise UserError(f"{where}: argument {value!r} is not an encoding this server reads"
                        + (" (device constants are refused: the server places tensors)" if kind == "device" else ""))


def _check_output(node: Node) -> None:
    out = node.args[0] if len(node.args) == 1 else None
    pair = out.get("tuple") if isinstance(out, dict) else out
    if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], dict) and "ref" in pair[0]):
        raise UserError("graph: the output must be (loss, metrics), the loss a tensor")
    metrics = pair[1].get("dict") if isinstance(pair[1], dict) else None
    if not isinstance(metrics, dict):
        raise UserError("graph: the output's metrics must be a dict")
    for key, value in metrics.items():
        if not _METRIC_KEY.fullmatch(key) or not (isinstance(value, dict) and "ref" in value):
            raise UserError(f"graph: metric {key!r} must be a tensor keyed custom/<name>:sum or custom/<name>:mean")


def _decode(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (kind, inner), = value.items()
        if kind == "ref":
            return env[inner]
        if kind == "tuple":
            return tuple(_decode(v, env) for v in inner)
        if kind == "dict":
            return {k: _decode(v, env) for k, v in inner.items()}
        if kind == "slice":
            return slice(*(_decode(v, env) for v in inner))
        if kind == "ellipsis":
            return Ellipsis
        if kind == "float":
            return _FLOATS[inner]
        return _CONSTANTS[kind][inner]
    raise UserError(f"custom loss: argument {value!r} is not an encoding this server reads")
