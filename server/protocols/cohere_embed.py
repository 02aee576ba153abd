"""Cohere's ``POST /v2/embed``, through the same queue and batcher.

The request and response are Cohere's v2 Embed API, so its ``cohere.ClientV2`` works
unmodified: ``texts`` (or ``inputs`` of text content), ``input_type`` mapped to the model's
prompts as sentence-transformers' ``encode_query`` and ``encode_document`` read them,
``embedding_types`` (several at once, each a key of ``embeddings``), ``output_dimension``
(Matryoshka) and ``truncate``. Errors read ``{"id", "message", "error_type"}``:
Cohere's id (the request id) and message, with our type beside them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from starlette.responses import Response
from starlette.types import ASGIApp

from models import STANDARD_PROMPT_NAMES, ModelInfo

from ..encodings import EmbedDtype, Encoding, check_encoding, encode_embeddings
from ..errors import ApiError, draining, request_id_of
from ..inference import (
    check_dimensions,
    check_inputs,
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
from ..routes import timeout_header
from ..schemas import MAX_PRIORITY
from .cohere_errors import CohereErrorBody, cohere_error_response
from .routes import protocol_route, protocol_validation

EMBED_PATH = "/v2/embed"
SCHEMA_STATUS = 400  # as Cohere answers a bad request

InputType = Literal["search_document", "search_query", "classification", "clustering", "image"]
CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
TRUNCATION_DIRECTIONS = {"START": "left", "END": "right"}
INPUT_TYPE_PROMPTS = {
    "search_query": "query",  # sentence-transformers' encode_query
    "search_document": "document",  # its encode_document: "document" is always a prompt there
    "classification": "classification",
    "clustering": "clustering",
}


class TextContent(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ImageContent(BaseModel):
    type: Literal["image_url"]
    image_url: Any = None


class EmbedInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    content: list[TextContent | ImageContent] = Field(
        description="Text parts, joined into one input (images are refused)."
    )


class CohereEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(
        None, description="The served embedder's name; default: the first embedder served."
    )
    texts: list[str] | None = Field(None, description="The texts to embed.")
    inputs: list[EmbedInput] | None = Field(
        None, description='Instead of texts: objects whose content lists {"type": "text"} parts.'
    )
    images: list[str] | None = Field(None, description="Refused: this server embeds text.")
    input_type: InputType | None = Field(
        None,
        description="search_query: the model's query prompt; search_document: its document "
        "prompt (none where the model has no prompt of that name, as sentence-transformers "
        "reads it); classification and clustering: the model's prompt of that name, else none. "
        "Default: the model's default prompt.",
    )
    embedding_types: list[CohereEmbeddingType] | None = Field(
        None,
        description="Any of float (default), base64 (float bytes), binary and ubinary (sign "
        "bits packed as sentence-transformers' quantize_embeddings packs them), int8 and uint8 "
        "(over the range -1 to 1, models that normalise only).",
    )
    embed_dtype: EmbedDtype | None = Field(
        None, description="Not in Cohere's API: the bytes of base64, float32 (default), "
        "float16 or bfloat16.",
    )  # fmt: skip
    output_dimension: int | None = Field(
        None,
        description="Keep the first output_dimension values (Matryoshka), renormalised where "
        "the model normalises; from 1 to the model's output size.",
    )
    truncate: Literal["NONE", "START", "END"] | None = Field(
        None,
        description="END cuts an over-long input's end, START its start; NONE answers 413 "
        "input_too_long, naming the model's limit. Default: the model's own side (GET "
        "/v1/models: truncation_direction; END, right, for most).",
    )
    priority: int = Field(
        0,
        ge=0,
        description="As Cohere's: lower runs first, 0 (default) the first; above "
        f"{MAX_PRIORITY} counts as {MAX_PRIORITY}.",
    )


class CohereEmbeddings(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    float_: list[list[float]] | None = Field(None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereEmbedResponse(BaseModel):
    id: str = Field(description="The request id.")
    embeddings: CohereEmbeddings
    texts: list[str]
    meta: dict[str, Any]
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": CohereErrorBody, "description": description}
    for code, description in {
        400: "Bad request: schema error, empty input, images, an embedding type or "
        "output_dimension the model cannot give",
        401: "Missing or wrong API key (when the server requires one)",
        404: "No model of that name is served (model_not_found)",
        413: "Body, input count or input length too large (truncate NONE)",
        415: "Body declared as something other than JSON",
        429: "Queue full; see Retry-After",
        503: "Not ready or draining; see Retry-After",
        504: "Deadline passed (X-Timeout-S)",
        507: "An input does not fit in memory even alone",
        500: "Unexpected error",
    }.items()
}

_validation = protocol_validation(SCHEMA_STATUS)
router = APIRouter(
    tags=["Cohere"],
    route_class=protocol_route(cohere_error_response, validation_status=SCHEMA_STATUS),
)
_BODY = TypeAdapter(CohereEmbedRequest)


def texts_of(body: CohereEmbedRequest) -> list[str]:
    """The request's texts: ``texts``, or each input's text parts joined."""
    if body.images:
        raise ApiError(400, "unsupported_input", "images are not supported; send text")
    if (body.texts is None) == (body.inputs is None):
        raise ApiError(SCHEMA_STATUS, "invalid_request", "give texts or inputs (one of them)")
    if body.texts is not None:
        return body.texts
    texts = []
    for index, item in enumerate(body.inputs or []):
        if any(isinstance(part, ImageContent) for part in item.content):
            raise ApiError(
                400, "unsupported_input", f"inputs {index} holds an image; send text content"
            )
        texts.append("".join(part.text for part in item.content if isinstance(part, TextContent)))
    return texts


def prompt_for(info: ModelInfo, input_type: str | None) -> tuple[str | None, str | None]:
    """``(prompt_name, prompt)`` for ``input_type``: none given, the model's default prompt."""
    if input_type is None:
        return None, None
    if input_type == "image":
        raise ApiError(400, "unsupported_input", "input_type image: this server embeds text")
    name = INPUT_TYPE_PROMPTS[input_type]
    if name in info.prompts or name in STANDARD_PROMPT_NAMES:
        return name, None
    return None, ""  # no prompt, not the default one


def encodings_for(
    info: ModelInfo, name: str, body: CohereEmbedRequest
) -> dict[str, Encoding]:  # fmt: skip
    """Each asked type's encoding, in the order asked (``float`` alone by default)."""
    encodings = {}
    for kind in dict.fromkeys(body.embedding_types or ["float"]):
        if kind == "base64":
            encoding = check_encoding(
                info, name, encoding_format="base64", embed_dtype=body.embed_dtype,
                schema_status=SCHEMA_STATUS,
            )  # fmt: skip
        else:
            encoding = check_encoding(info, name, kind=kind, schema_status=SCHEMA_STATUS)
        encodings[kind] = encoding
    if body.embed_dtype not in (None, "float32") and "base64" not in encodings:
        raise ApiError(SCHEMA_STATUS, "invalid_request", "embed_dtype applies to base64")
    return encodings


async def handle_embed(request: Request) -> ASGIApp:
    """``POST /v2/embed`` on the lean path (``server/lean``)."""
    raw = await read_body(request.receive)
    runtime = runtime_of(request)
    if runtime.draining:  # at once: Nginx retries it on another replica
        raise draining()
    require_json_media_type(request.headers.get("content-type"))
    header_timeout, header_errors = timeout_header(request)
    body = parse_body(_BODY, raw)
    if header_errors:
        raise ApiError(SCHEMA_STATUS, "invalid_request", "X-Timeout-S must be a positive number")
    slot = slot_for_task(request, body.model, ("embed",), EMBED_PATH, default_task="embed")
    texts = texts_of(body)
    check_inputs(runtime, texts, field="texts", schema_status=SCHEMA_STATUS)
    check_dimensions(slot.info, body.output_dimension, name=slot.name)
    encodings = encodings_for(slot.info, slot.name, body)
    prompt_name, prompt = prompt_for(slot.info, body.input_type)
    request_id = request_id_of(request)
    outputs, num_tokens = await infer_for_request(
        request, texts, request_id=request_id, model=slot.name, timeout_s=header_timeout,
        truncate=body.truncate != "NONE",
        truncation_direction=TRUNCATION_DIRECTIONS.get(body.truncate or ""),
        priority=-min(body.priority, MAX_PRIORITY), prompt_name=prompt_name, prompt=prompt,
        dimensions=body.output_dimension,
    )  # fmt: skip
    embeddings = {kind: encode_embeddings(outputs, enc) for kind, enc in encodings.items()}
    answer = {
        "id": request_id,
        "embeddings": embeddings,
        "texts": texts,
        "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": num_tokens}},
        "response_type": "embeddings_by_type",
    }
    return JsonAnswer(encode_json(answer))


# The OpenAPI entry of POST /v2/embed; ``handle_embed`` serves it (``server/lean``).
async def embed(body: CohereEmbedRequest, request: Request) -> Response:
    raise AssertionError("handle_embed serves this route")


router.add_api_route(
    EMBED_PATH,
    embed,
    methods=["POST"],
    response_model=CohereEmbedResponse,
    response_model_exclude_none=True,
    responses=ERROR_RESPONSES,
    summary="Embed texts (Cohere v2-compatible)",
    route_class_override=lean_route(
        handle_embed, render=cohere_error_response, validation=_validation
    ),
)
