"""The SGLang native HTTP API (docs/architecture.md §5) as Tandem speaks it.

Field names follow SGLang's own request structs (``GenerateReqInput``,
``UpdateWeightFromDiskReqInput``, ``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``) and its
``/generate`` reply. The embedded
engine serves these models; the rollout service sends and parses them, so the
same rollout code drives SGLang on GPU and the embedded engine on CPU.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.contracts.messages import FinishReason


class GenerateSamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    max_new_tokens: int = Field(128, ge=0, le=2**20)
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    sampling_seed: int | None = Field(None, ge=0, le=2**63 - 1)
    n: int = Field(1, ge=1, le=64, description="samples per prompt; n > 1 answers with a list")
    ignore_eos: bool = False


class GenerateReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    rid: str | None = None
    stream: Literal[False] = False
    lora_path: str | None = Field(None, min_length=1, description="the loaded adapter's name (SGLang's field "
                                  "name); None: the base model")

    @model_validator(mode="after")
    def _one_input(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.input_ids is not None and len(self.input_ids) == 0:
            raise ValueError("input_ids is empty")
        if self.text is not None and self.text == "":
            raise ValueError("text is empty")
        return self


class FinishInfo(BaseModel):
    """SGLang's ``BaseFinishReason.to_json()``: stop {matched}, length {length}, abort {message, ...}; ``type``
    is the one ``FinishReason`` of the contracts."""

    type: FinishReason
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class WeightVersionSpan(BaseModel):
    """SGLang's ``meta_info.weight_versions`` item: output tokens [start, end) came from ``version``."""

    version: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class MetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishInfo
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    weight_versions: list[WeightVersionSpan] | None = None
    cached_tokens: int = 0
    # SGLang shape: one [logprob, token_id, token_text_or_None] per output token
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None


class GenerateReqOutput(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class UpdateWeightFromDiskReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightFromDiskReqOutput(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = 0


class LoadLoRAAdapterReqInput(BaseModel):
    """``/load_lora_adapter``: serve the PEFT adapter directory ``lora_path`` as ``lora_name``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False


class UnloadLoRAAdapterReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


class LoRAUpdateOutput(BaseModel):
    """SGLang's answer to both adapter routes (200 on success, 400 otherwise)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None


class AbortReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    torch_empty_cache: bool = True


def error_body(message: str, code: int = 400) -> dict[str, Any]:
    """SGLang's error shapes in one object: ``{"error": {"message"}}`` as its native ``/generate``
    answers, and the OpenAI-style ``{"object": "error", "message", "type", "param", "code"}`` of its
    other endpoints."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": code},
            "object": "error", "message": message, "type": "BadRequestError", "param": None, "code": code}
