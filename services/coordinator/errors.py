"""The control API's error answers as the OpenAPI document publishes them (docs/architecture.md §6).

Every 4xx the API gives has a body ``{"detail": str}`` (``ErrorBody``: FastAPI's ``HTTPException``); a
request that fails validation gets ``{"detail": "invalid request", "errors": [{"field", "message"}]}``
(``ValidationErrorBody``, the API's own handler). A route that needs Redis while it is unreachable answers
503 ``{"detail": str}`` with ``Retry-After`` (never a 500); ``/v1/status`` answers 200 without its Redis-backed
counts and says ``"redis": "unavailable: ..."``. ``responses(...)`` is what a route declares, so the
document lists each status it can answer with the body it really sends.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    detail: str = Field(description="what is wrong")


class FieldError(BaseModel):
    field: str = Field(description="where: the part of the request and the field, dotted (query.limit)")
    message: str


class ValidationErrorBody(BaseModel):
    detail: str = Field(description="'invalid request', or what is wrong with a value")
    errors: list[FieldError] = Field(default_factory=list, description="one entry per invalid field")


WHY = {
    401: "api.token is configured and the request does not carry 'Authorization: Bearer <api.token>'",
    404: "no such thing (the message names it)",
    409: "the run's phase does not allow it now (the message says why)",
    422: "a parameter is invalid (each field is named)",
    503: "Redis, the run's store, is unreachable or cannot write (a restart, a full disk): retry shortly; the "
         "run waits for it",
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that can answer with ``codes``."""
    return {code: {"model": ValidationErrorBody if code == 422 else ErrorBody, "description": WHY[code]}
            for code in codes}
