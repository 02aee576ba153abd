"""OpenAI-compatible ``POST /v1/embeddings``, through the same queue and batcher.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with our
``error_type`` as ``code``, so the official client raises its usual exceptions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from starlette.responses import Response
from starlette.types import ASGIApp

from models import UnknownPrompt

from ..encodings import (
    EmbeddingType,
    EmbedDtype,
    Encoding,
    check_encoding,
    encode_embeddings,
    one_embedding_type,
)
from ..errors import ApiError, draining, request_id_of
from ..inference import (
    check_dimensions,
    check_inputs,
    check_prompt,
    infer_for_request,
    runtime_of,
    slot_for_task,
)
from ..lean import (
    JsonAnswer,
    encode_json,
    lean_route,
    parse_body,
    read_body,
    require_json_media_type,
)
from ..long_inputs import TRUNCATE_DESCRIPTION, Truncate
from ..schemas import LateChunks
from .routes import describe, protocol_route, retry_headers

# Schema errors are 400 here, as OpenAI answers them.
SCHEMA_STATUS = 400


class EmbeddingRequest(BaseModel):
    # Strict, as /v1/infer's body: true is no number of dimensions, nor "5".
    model_config = ConfigDict(extra="forbid", strict=True)

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="One text or a list of texts (token-id arrays are refused with 400)."
    )
    model: str = Field(description="The served model's name, as GET /v1/models lists it.")
    encoding_format: Literal["float", "base64"] = Field(
        "float",
        description="float: lists of numbers; base64: each embedding's little-endian bytes "
        "(float32 unless embed_dtype says otherwise; a quantized type's own bytes).",
    )
    embed_dtype: EmbedDtype | None = Field(
        None,
        description="Not in OpenAI's API: with base64, the bytes' type: float32 (default), "
        "float16 or bfloat16, as vLLM's embed_dtype.",
    )
    embedding_types: EmbeddingType | list[EmbeddingType] | None = Field(
        None,
        description="Not in OpenAI's API: one of float (default), binary and ubinary (sign "
        "bits packed 8 to a byte, as int8 or uint8 numbers), int8 and uint8 (models that "
        "normalise only); a string or a list of one.",
    )
    dimensions: int | None = Field(
        None,
        description="Keep the first dimensions values of each embedding (Matryoshka), "
        "renormalised when the model normalises; from 1 to the model's output size.",
    )
    user: str | None = Field(None, description="Accepted and ignored.")
    prompt_name: str | None = Field(
        None,
        description="Not in OpenAI's API (send it in the client's extra_body): one of the "
        "model's prompts, put in front of every input; default: the model's default prompt.",
    )
    prompt: str | None = Field(
        None,
        description='Not in OpenAI\'s API: a literal prompt put in front of every input ("" for '
        "none), instead of a named one.",
    )
    truncate: Truncate = Field(None, description=f"Not in OpenAI's API: {TRUNCATE_DESCRIPTION}")
    late_chunks: LateChunks | None = Field(
        None,
        description="Not in OpenAI's API: character spans, as on /v1/infer. data then holds "
        "one embedding per span, in input order then span order; each says its input_index "
        "and chunk_index.",
    )


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | list[int] | str
    input_index: int | None = Field(
        None, description="With late_chunks only: the input this span's embedding is of."
    )
    chunk_index: int | None = Field(
        None, description="With late_chunks only: the span's place in that input's list."
    )


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class OpenAIErrorBody(BaseModel):
    error: OpenAIError


def openai_error_response(request: Request, error: ApiError, param: str | None = None) -> Response:
    if error.status >= 500:
        kind = "server_error"
    elif error.status == 429:
        kind = "rate_limit_error"
    else:
        # NOTE: 401 too, as OpenAI answers a wrong key (its client picks the exception,
        # AuthenticationError, by the status).
        kind = "invalid_request_error"
    body = {
        "error": {
            "message": error.message,
            "type": kind,
            "param": getattr(error, "param", param),
            "code": error.error_type,
        }
    }
    return Response(
        orjson.dumps(body),
        status_code=error.status,
        headers=retry_headers(error),
        media_type="application/json",
    )


class ParamError(ApiError):
    def __init__(self, status: int, error_type: str, message: str, param: str | None) -> None:
        super().__init__(status, error_type, message)
        self.param = param


def validation_for(body: type[BaseModel]) -> Callable[[RequestValidationError], ParamError]:
    """Schema errors of ``body``: 400 ``invalid_request``, ``param`` the field at fault where
    it is one of the body's (an unknown field is no parameter of the API)."""

    def validation(exc: RequestValidationError) -> ParamError:
        errors = exc.errors()
        fields = {
            error["loc"][1]
            for error in errors
            if len(error.get("loc", ())) > 1 and error["loc"][0] == "body"
        }
        param = fields.pop() if len(fields) == 1 else None
        if param not in body.model_fields:
            param = None
        return ParamError(SCHEMA_STATUS, "invalid_request", describe(errors), param)

    return validation


openai_validation = validation_for(EmbeddingRequest)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIErrorBody, "description": description}
    for code, description in {
        400: "Bad request: unparsable body, schema error, empty input, dimensions out of "
        "range, an unknown prompt name, token ids",
        401: "Missing or wrong API key (when the server requires one)",
        404: "No model of that name is served (model_not_found)",
        413: "Body, input count or input length too large",
        415: "Body declared as something other than JSON",
        429: "Queue full; see Retry-After",
        503: "Not ready or draining; see Retry-After",
        504: "Deadline passed",
        507: "An input does not fit in memory even alone",
        500: "Unexpected error",
    }.items()
}

router = APIRouter(
    tags=["OpenAI"],
    route_class=protocol_route(openai_error_response, validation_status=SCHEMA_STATUS),
)


_EMBEDDING_BODY = TypeAdapter(EmbeddingRequest)


async def handle_embeddings(request: Request) -> ASGIApp:
    """``POST /v1/embeddings`` on the lean path (``server/lean``)."""
    raw = await read_body(request.receive)
    runtime = runtime_of(request)
    if runtime.draining:  # at once, as /v1/infer: Nginx retries it on another replica
        raise draining()
    require_json_media_type(request.headers.get("content-type"))
    body = parse_body(_EMBEDDING_BODY, raw)
    try:
        slot = slot_for_task(request, body.model, ("embed",), "/v1/embeddings")
    except ApiError as exc:
        if exc.status != 404 and exc.error_type != "wrong_task":
            raise
        raise ParamError(exc.status, exc.error_type, exc.message, "model") from None
    try:
        check_dimensions(slot.info, body.dimensions, name=slot.name)
    except ApiError as exc:
        raise ParamError(exc.status, exc.error_type, exc.message, "dimensions") from None
    encoding = _encoding(slot, body)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    if any(not isinstance(text, str) for text in inputs):
        raise ParamError(
            400, "unsupported_input", "token-id arrays are not supported; send text", "input"
        )
    check_inputs(runtime, inputs, field="input", schema_status=SCHEMA_STATUS)
    check_prompt(body.prompt_name, body.prompt, schema_status=SCHEMA_STATUS)
    try:
        outputs, num_tokens = await infer_for_request(
            request, inputs, request_id=request_id_of(request), model=slot.name,
            prompt_name=body.prompt_name, prompt=body.prompt, dimensions=body.dimensions,
            truncate=body.truncate, late_chunks=body.late_chunks, schema_status=SCHEMA_STATUS,
        )  # fmt: skip
    except UnknownPrompt as exc:
        raise ParamError(400, "unknown_prompt", str(exc), "prompt_name") from None
    except ApiError as exc:
        if exc.error_type != "invalid_late_chunks":
            raise
        raise ParamError(exc.status, exc.error_type, exc.message, "late_chunks") from None
    late = body.late_chunks is not None
    return JsonAnswer(encode_openai_embeddings(slot.name, outputs, num_tokens, encoding, late=late))


def _encoding(slot: Any, body: EmbeddingRequest) -> Encoding:
    """The request's output encoding (``server/encodings.py``), its errors naming the field."""
    try:
        kind = one_embedding_type(body.embedding_types, schema_status=SCHEMA_STATUS)
    except ApiError as exc:
        raise ParamError(exc.status, exc.error_type, exc.message, "embedding_types") from None
    try:
        return check_encoding(
            slot.info, slot.name, kind=kind, encoding_format=body.encoding_format,
            embed_dtype=body.embed_dtype, schema_status=SCHEMA_STATUS,
        )  # fmt: skip
    except ApiError as exc:
        param = "embed_dtype" if exc.error_type == "invalid_request" else "embedding_types"
        raise ParamError(exc.status, exc.error_type, exc.message, param) from None


def encode_openai_embeddings(
    model: str, outputs: list[Any], num_tokens: int, encoding: Encoding, *, late: bool = False
) -> bytes:
    """float: each vector written by orjson from its float32 buffer; base64: its bytes in the
    encoding's dtype; quantized types as lists of ints (or their bytes in base64). ``late``:
    each output is a list of vectors (late chunks), each its own embedding object."""
    if late:
        where = [{"input_index": i, "chunk_index": j}
                 for i, output in enumerate(outputs) for j in range(len(output))]  # fmt: skip
        outputs = [row for output in outputs for row in output]
    embeddings = encode_embeddings(outputs, encoding)
    data = [
        {"object": "embedding", "index": index, "embedding": embedding,
         **(where[index] if late else {})}
        for index, embedding in enumerate(embeddings)
    ]  # fmt: skip
    payload = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
    return encode_json(payload)


# The OpenAPI entry of POST /v1/embeddings; ``handle_embeddings`` serves it (``server/lean``).
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    raise AssertionError("handle_embeddings serves this route")


router.add_api_route(
    "/v1/embeddings",
    create_embeddings,
    methods=["POST"],
    response_model=EmbeddingResponse,
    responses=ERROR_RESPONSES,
    summary="Create embeddings (OpenAI-compatible)",
    route_class_override=lean_route(
        handle_embeddings, render=openai_error_response, validation=openai_validation
    ),
)
