"""Cohere-compatible ``POST /v2/rerank``, through the same checks, queue and batcher as
``/v1/rerank`` (``server/rerank.py``).

Request and answer follow Cohere's v2 Rerank API: ``documents`` as strings (or, as its v1
allowed, ``{"text": ...}`` objects), ``top_n``, ``max_tokens_per_doc``; the answer is
``{"id", "results": [{"index", "relevance_score"}], "meta"}``. ``return_documents`` (from
Cohere's v1) adds each result's ``document``. Errors take Cohere's shape, ``{"id",
"message"}``, with our ``error_type`` beside them, so its client raises its usual exceptions.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WithJsonSchema
from starlette.responses import Response
from starlette.types import ASGIApp

from ..errors import ApiError
from ..lean import JsonAnswer, encode_json, lean_route, parse_body
from ..rerank import Ranking, TimeoutParameter, rank_documents
from ..routes import read_json_request
from ..schemas import MIN_PRIORITY
from .cohere_errors import CohereErrorBody, cohere_error_response
from .routes import describe

ENDPOINT = "/v2/rerank"
# Schema errors are 400 here, as Cohere answers them.
SCHEMA_STATUS = 400
_TEXT = {"type": "string", "minLength": 1}
_TEXT_OBJECT = {
    "type": "object", "properties": {"text": _TEXT}, "required": ["text"],
    "additionalProperties": False,
}  # fmt: skip


class CohereDocument(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(description="The document's text.")


class CohereRerankRequest(BaseModel):
    # NOTE: unknown fields are ignored, as Cohere's API ignores them: its client sends the
    # fields of its newest version, which this route need not know.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(
        None,
        description="Which served reranker scores the documents, by name; default: the "
        "first reranker. Unknown: 404 model_not_found.",
    )
    query: Annotated[str, WithJsonSchema(_TEXT)] = Field(
        description="The text the documents are scored against; not empty (400 empty_input)."
    )
    documents: Annotated[
        list[str | CohereDocument],
        WithJsonSchema({"type": "array", "items": {"anyOf": [_TEXT, _TEXT_OBJECT]}}),
    ] = Field(
        description='The texts to score, as strings or {"text": ...} objects; at least one, '
        "at most the server's --max-rerank-documents (413 too_many_inputs)."
    )
    top_n: int | None = Field(
        None,
        description="Return at most the best top_n results (beyond the number of documents, "
        "all of them); at least 1 (else 422 invalid_top_n). Default: all of them.",
    )
    max_tokens_per_doc: int | None = Field(
        None,
        ge=1,
        description="Cut each document to its first max_tokens_per_doc tokens before it is "
        "paired with the query. Default: no cut beyond the model's maximum length.",
    )
    return_documents: bool = Field(
        False, description="Include each result's document as document.text (Cohere's v1)."
    )
    raw_scores: bool = Field(
        False,
        description="Not Cohere's: scores before the model's score function, as on /v1/rerank.",
    )
    priority: int = Field(
        0,
        ge=0,
        le=-MIN_PRIORITY,
        description="Cohere's: lower is handled earlier, 0 (the default) first. Runs as "
        "Batchfit's priority -priority (/v1/infer's, where higher runs first).",
    )


class CohereResultDocument(BaseModel):
    text: str


class CohereRerankResult(BaseModel):
    index: int = Field(description="The document's position in the request.")
    relevance_score: float = Field(
        description="The cross-encoder's logit through its activation, as /v1/rerank's."
    )
    document: CohereResultDocument | None = Field(None, description="With return_documents.")


class CohereRerankResponse(BaseModel):
    id: str = Field(description="The request's id (X-Request-ID).")
    results: list[CohereRerankResult]
    meta: dict[str, Any] = Field(
        description="api_version and billed_units as Cohere's (search_units: 1 per request), "
        "and tokens.input_tokens: the pairs' tokens."
    )


def cohere_validation(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if any(error.get("type") == "json_invalid" for error in errors):
        return ApiError(400, "invalid_json", "request body is not valid JSON")
    return ApiError(SCHEMA_STATUS, "invalid_request", describe(errors))


_BODY = TypeAdapter(CohereRerankRequest)


async def handle_cohere_rerank(request: Request) -> ASGIApp:
    """``POST /v2/rerank`` on the lean path (``server/lean``)."""
    body = parse_body(_BODY, await read_json_request(request))
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    ranking = await rank_documents(
        request, model=body.model, query=body.query, documents=documents, top_n=body.top_n,
        endpoint=ENDPOINT, max_tokens_per_doc=body.max_tokens_per_doc, priority=-body.priority,
        schema_status=SCHEMA_STATUS, raw_scores=body.raw_scores,
    )  # fmt: skip
    return JsonAnswer(encode_cohere_rerank(ranking, documents, body.return_documents))


def encode_cohere_rerank(ranking: Ranking, documents: list[str], return_documents: bool) -> bytes:
    results = []
    for index in ranking.ranked:
        result: dict[str, object] = {"index": index, "relevance_score": ranking.scores[index]}
        if return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    meta = {
        "api_version": {"version": "2"},
        "billed_units": {"search_units": 1},
        "tokens": {"input_tokens": ranking.num_tokens},
    }
    return encode_json({"id": ranking.request_id, "results": results, "meta": meta})


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": CohereErrorBody, "description": description}
    for code, description in {
        400: "Unparsable body, schema error, empty query or document, a model of another task",
        401: "Missing or wrong API key (when the server requires one)",
        404: "No model of that name is served (model_not_found)",
        413: "Body, document count or document length too large",
        415: "Body declared as something other than JSON",
        422: "top_n below 1",
        429: "Queue full; see Retry-After",
        503: "Not ready or draining; see Retry-After",
        504: "Deadline passed",
        507: "A pair does not fit in memory even alone",
        500: "Unexpected error",
    }.items()
}

router = APIRouter(tags=["Cohere"])


# The OpenAPI entry of POST /v2/rerank; ``handle_cohere_rerank`` serves it (``server/lean``).
async def cohere_rerank(
    body: CohereRerankRequest, request: Request, x_timeout_s: TimeoutParameter = None
) -> Response:
    raise AssertionError("handle_cohere_rerank serves this route")


router.add_api_route(
    ENDPOINT,
    cohere_rerank,
    methods=["POST"],
    response_model=CohereRerankResponse,
    response_model_exclude_none=True,
    responses=ERROR_RESPONSES,
    summary="Rerank documents against a query (Cohere-compatible)",
    route_class_override=lean_route(
        handle_cohere_rerank, render=cohere_error_response, validation=cohere_validation
    ),
)
