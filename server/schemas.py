"""Request and response bodies of the HTTP API."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class InferRequest(BaseModel):
    # Unknown fields are refused (422) so that a typo such as "input" is not silently ignored.
    model_config = ConfigDict(extra="forbid")

    inputs: str | list[str] = Field(description="One text or a list of texts.")
    truncate: bool = Field(
        True,
        description="Cut inputs to the model's maximum length; when false an over-long input "
        "gets 413.",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Deadline in seconds from arrival; capped by the server's max_timeout_s.",
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


class ErrorBody(BaseModel):
    error: str
    error_type: str
    request_id: str
