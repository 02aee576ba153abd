"""Bodies of the Open Inference Protocol (KServe v2) REST API."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

# Triton's binary tensor data extension: the JSON header's length, the raw tensors after it.
HEADER_LENGTH = "Inference-Header-Content-Length"


class RequestInput(BaseModel):
    name: str
    shape: list[int] = Field(description="e.g. [N] or [N, 1] for N texts.")
    datatype: str = Field(description="BYTES (UTF-8 text) is the only type accepted.")
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = Field(
        None, description="Row-major values, flat or nested; absent with binary data."
    )


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = Field(
        None, description="binary_data: true returns this tensor in the binary extension."
    )


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = Field(
        None,
        description="Optional truncate (end, start, none, chunk, or a bool; default the "
        "server's --truncate), truncation_direction (right or "
        "left, default the model's), timeout_s (seconds) and binary_data_output (bool).",
    )
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    outputs: list[ResponseOutput]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any] | None = None


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class LiveResponse(BaseModel):
    live: bool


class ReadyResponse(BaseModel):
    ready: bool


class ModelReadyResponse(BaseModel):
    name: str
    ready: bool


class V2Error(BaseModel):
    error: str


def _inline_refs(schema: Any, defs: dict[str, Any]) -> Any:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(v, defs) for v in schema]
    return schema


def _request_body() -> dict[str, Any]:
    schema = InferenceRequest.model_json_schema()
    json_schema = _inline_refs(schema, schema.get("$defs", {}))
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": json_schema},
                "application/octet-stream": {
                    "schema": {"type": "string", "format": "binary"},
                    "description": f"Binary tensor data extension: a JSON header of "
                    f"{HEADER_LENGTH} bytes, then the raw tensors.",
                },
            },
        }
    }


# The body is parsed by hand (it may carry binary tensors), so it is described here.
REQUEST_BODY = _request_body()
