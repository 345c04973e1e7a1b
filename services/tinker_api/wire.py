"""The Tinker wire format: request bodies in, result bodies out.

``forward_backward`` requests and the results of ``forward_backward`` and ``asample`` are
protobuf (the generated module the official SDK ships, ``tinker.proto.tinker_public_pb2``);
every other message is JSON, validated here by pydantic models that name only the fields
the service reads (unknown fields are ignored, so newer SDKs keep working).
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from tinker.proto import tinker_public_pb2 as pb

from services.tinker_api.lora_host import Datum
from services.tinker_api.losses import UserError

_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionProject(Body):
    project_id: str = Field(min_length=1)


class SessionSearch(Body):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = Field(None, min_length=1)
    owner: dict[str, Any] = {"type": "own"}
    statuses: list[dict[str, Any]] | None = Field(None, min_length=1)
    limit: int = Field(50, ge=1, le=200)
    cursor: dict[str, Any] | None = None


class CopyWeights(Body):
    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    destination_project_id: str | None = None
    ttl_seconds: int | None = None


class SessionRef(Body):
    session_id: str


class LoraSpec(Body):
    rank: int = Field(32, ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str = Field(min_length=1)
    lora_config: LoraSpec | None = None
    optimizer_config: dict[str, Any] | None = None
    user_metadata: dict[str, Any] | None = None


class CreateCustomLoss(Body):
    session_id: str
    custom_loss_seq_id: int = Field(ge=0)
    name: str = Field(min_length=1, max_length=200)
    inputs: list[dict[str, Any]]
    graph: dict[str, Any]


class ModelRef(Body):
    model_id: str


class AdamSpec(Body):
    learning_rate: float = Field(1e-4, ge=0, allow_inf_nan=False)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    grad_clip_norm: float = Field(0.0, allow_inf_nan=False)


class OptimStep(Body):
    model_id: str
    seq_id: int = Field(ge=1)
    adam_params: AdamSpec | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(Body):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"


class SaveExternal(Body):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str
    ttl_seconds: int | None = Field(None, ge=1)
    age_encryption_recipients: list[str] | None = Field(None, max_length=10)


class CheckpointTtl(Body):
    ttl_seconds: int | None = Field(None, ge=1)


class WeightsInfoRequest(Body):
    tinker_path: str


class LoadWeights(Body):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class SamplingSpec(Body):
    max_tokens: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class Chunk(Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int]


class Prompt(Body):
    chunks: list[dict[str, Any]]

    def tokens(self) -> list[int]:
        out: list[int] = []
        for i, c in enumerate(self.chunks):
            if c.get("type", "encoded_text") != "encoded_text":
                raise UserError(f"prompt.chunks[{i}]: only encoded_text chunks are served here, got {c.get('type')}")
            out.extend(Chunk.model_validate(c).tokens)
        return out


class Sample(Body):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    num_samples: int = Field(1, ge=1, le=1024)
    prompt: Prompt
    sampling_params: SamplingSpec
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None


class SamplerRef(Body):
    sampling_session_id: str


class FutureRef(Body):
    request_id: str
    allow_metadata_only: bool = False


# -- protobuf: forward_backward in ------------------------------------------------------------
def _tensor(msg: Any, where: str) -> torch.Tensor:
    dtype = _NP.get(msg.dtype)
    if dtype is None:
        raise UserError(f"{where}: unsupported dtype {msg.dtype}")
    shape = [int(s) for s in msg.shape]
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        values = torch.from_numpy(np.frombuffer(csr.values, dtype=dtype).copy())
        crow = torch.from_numpy(np.frombuffer(csr.crow_indices, dtype=np.int64).copy())
        col = torch.from_numpy(np.frombuffer(csr.col_indices, dtype=np.int64).copy())
        try:
            return torch.sparse_csr_tensor(crow, col, values, size=shape).to_dense()
        except RuntimeError as exc:
            raise UserError(f"{where}: bad sparse tensor: {exc}") from None
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    if shape and math.prod(shape) != arr.size:
        raise UserError(f"{where}: {arr.size} values do not fill shape {shape}")
    return torch.from_numpy(arr.reshape(shape) if shape else arr)


def parse_forward_backward(body: bytes) -> Any:
    """The ForwardBackwardRequest protobuf, not yet checked; a UserError if the body is not one."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise UserError(f"forward_backward: body is not a ForwardBackwardRequest protobuf: {exc}") from None
    return msg


def sequence_ref(body: bytes, proto: bool) -> tuple[str, int] | None:
    """(model_id, seq_id) a request names, read as leniently as possible (for recording a refusal)."""
    if proto:
        try:
            msg = parse_forward_backward(body)
        except UserError:
            return None
        return (msg.model_id, int(msg.seq_id)) if msg.model_id else None
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    model_id, seq = doc.get("model_id"), doc.get("seq_id")
    if isinstance(model_id, str) and isinstance(seq, int) and not isinstance(seq, bool):
        return model_id, seq
    return None


def loss_config(msg: Any) -> dict[str, float | str]:
    """A ForwardBackwardRequest's loss_fn_config: the v2 map (numbers and text) over the float-only one."""
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return config


def custom_loss_id(body: bytes) -> str | None:
    """The ``loss_id`` a ``custom`` forward_backward names; None for a built-in loss."""
    msg = parse_forward_backward(body)
    if msg.loss_fn != "custom":
        return None
    loss_id = loss_config(msg).get("loss_id")
    if not isinstance(loss_id, str) or not loss_id:
        raise UserError("loss_fn_config.loss_id: a custom loss is named by the loss_id create_custom_loss returned")
    return loss_id


def decode_forward_backward(body: bytes) -> tuple[str, int, str, dict[str, float | str], list[Datum], bool]:
    """(model_id, seq_id, loss_fn, loss_fn_config, data, forward_only) from the protobuf body."""
    msg = parse_forward_backward(body)
    config = loss_config(msg)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for j, chunk in enumerate(d.model_input):
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise UserError(f"data[{i}].model_input[{j}]: only encoded_text chunks are served here")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {k: _tensor(v, f"data[{i}].loss_fn_inputs.{k}") for k, v in d.loss_fn_inputs.items()}
        data.append(Datum(tokens=tokens, inputs=inputs))
    if not data:
        raise UserError("forward_backward: data is empty")
    return msg.model_id, int(msg.seq_id), msg.loss_fn, config, data, bool(msg.forward_only)


# -- protobuf: results out --------------------------------------------------------------------
def encode_forward_backward(logprobs: list[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord whose ``logprobs`` field holds every datum's logprobs."""
    arrays = [lp.detach().to(torch.float32).contiguous().numpy() for lp in logprobs]
    trailing = list(arrays[0].shape[1:]) if arrays else []
    if any(list(a.shape[1:]) != trailing for a in arrays):  # ragged [N, K]: one record per datum
        records = [_record([a]) for a in arrays]
    else:
        records = [_record(arrays)]
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=records, metrics=metrics)
    return out.SerializeToString()


def _record(arrays: list[np.ndarray]) -> Any:
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    field = pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
                             dtype=pb.DTYPE_FLOAT32, trailing_shape=list(arrays[0].shape[1:]))
    return pb.ArrayRecord(type_tag="ArrayRecord", fields={"logprobs": field}, num_datums=len(arrays))


def encode_sample(sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float | None] | None,
                  topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> bytes:
    """SampleResponse: per sequence (tokens, logprobs, stop reason "stop" | "length"); prompt logprobs NaN-first."""
    seqs = [pb.SampledSequence(stop_reason=pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH,
                               tokens=np.asarray(toks, dtype=np.int32).tobytes(),
                               logprobs=np.asarray(lps, dtype=np.float32).tobytes())
            for toks, lps, reason in sequences]
    out = pb.SampleResponse(sequences=seqs)
    if prompt_logprobs is not None:
        vals = [math.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(vals, dtype=np.float32).tobytes()
    if topk is not None:
        ids, lps = topk
        out.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(
            token_ids=ids.numpy().astype(np.int32).tobytes(), logprobs=lps.numpy().astype(np.float32).tobytes(),
            k=int(ids.shape[1]), length=int(ids.shape[0])))
    return out.SerializeToString()
