"""Request and response bodies of the HTTP API."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

MIN_PRIORITY, MAX_PRIORITY = -10, 10
# What the route accepts, stricter than the Python type says: empty strings and an empty list
# are refused by the route itself (400 empty_input), so the schema documents them as invalid.
_TEXT = {"type": "string", "minLength": 1}
INPUTS_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}]}


class InferRequest(BaseModel):
    # Unknown fields are refused (422) so that a typo such as "input" is not silently ignored;
    # strict types, so "1" is not a number and "yes" not a boolean.
    model_config = ConfigDict(extra="forbid", strict=True)

    inputs: Annotated[str | list[str], WithJsonSchema(INPUTS_SCHEMA)] = Field(
        description="One text or a list of texts; no empty ones (400 empty_input)."
    )
    truncate: bool = Field(
        True,
        description="Cut inputs to the model's maximum length; when false an over-long input "
        "gets 413.",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Deadline in seconds from arrival; capped by the server's max_timeout_s. "
        "The X-Timeout-S header does the same; given both, the smaller wins.",
    )
    priority: int = Field(
        0,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="Higher runs first; FIFO within a priority. A waiting item gains one level "
        "every priority_aging_s seconds (server setting), so work arriving more than "
        "d x priority_aging_s later never overtakes an item d levels below: no starvation.",
    )
    model: str | None = Field(
        None,
        description="Which served model runs the inputs, by name as GET /v1/models lists it; "
        "default: the first model the server was started with. Unknown: 404 model_not_found.",
    )


class Usage(BaseModel):
    input_tokens: int


class ClassificationOutput(BaseModel):
    label: str
    score: float


class InferResponse(BaseModel):
    model: str
    outputs: list[list[float]] | list[ClassificationOutput]
    usage: Usage
    request_id: str


class ModelCard(BaseModel):
    name: str
    task: str
    device: str
    dtype: str
    max_input_tokens: int
    output_dim: int | None


class ModelList(BaseModel):
    models: list[ModelCard]


class Status(BaseModel):
    status: str


class ErrorBody(BaseModel):
    error: str
    error_type: str
    request_id: str
