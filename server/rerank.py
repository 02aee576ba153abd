"""``POST /v1/rerank``: score documents against a query with a cross-encoder.

The request and response follow the widely used rerank APIs: results sorted by
``relevance_score`` (the model's one logit through the activation its configuration names,
sigmoid when it names none), descending. Each (query, document)
pair is one queue item whose cost is the pair's token count after truncation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WithJsonSchema
from starlette.responses import Response
from starlette.types import ASGIApp

from .errors import ApiError, error_response, request_id_of, validation_error
from .inference import check_inputs, infer_for_request, slot_for_task
from .lean import JsonAnswer, encode_json, lean_route, parse_body
from .routes import (
    ERROR_RESPONSES,
    TIMEOUT_HEADER,
    read_json_request,
    require_json,
    require_serving,
    timeout_header,
)
from .schemas import MAX_PRIORITY, MIN_PRIORITY, Usage

_TEXT = {"type": "string", "minLength": 1}


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    query: Annotated[str, WithJsonSchema(_TEXT)] = Field(
        description="The text the documents are scored against; not empty (400 empty_input)."
    )
    documents: Annotated[list[str], WithJsonSchema({"type": "array", "items": _TEXT})] = Field(
        description="The texts to score; at least one, at most the server's "
        "--max-rerank-documents (413 too_many_inputs), none empty (400 empty_input)."
    )
    top_n: int | None = Field(
        None,
        description="Return at most the best top_n results (a limit, as in Cohere's and "
        "Jina's rerank APIs: beyond the number of documents, all of them); at least 1 "
        "(else 422 invalid_top_n). Default: all of them.",
    )
    return_documents: bool = Field(
        False, description="Include each result's document text as document.text."
    )
    raw_scores: bool = Field(
        False,
        description="Scores before the model's score function: a sigmoid's logits (within "
        "±36), as text-embeddings-inference's raw_scores. A model whose score function is "
        "neither a sigmoid nor the identity: 400 unsupported_parameter.",
    )
    truncation_direction: Literal["right", "left"] | None = Field(
        None,
        description="Which end truncation cuts a pair from (the longer side first): right "
        "keeps the start, left the end. Default: the model's own.",
    )
    max_tokens_per_doc: int | None = Field(
        None,
        ge=1,
        description="Cut each document to this many of its own tokens before it is paired "
        "with the query (from the end truncation_direction names), as Cohere's rerank API "
        "does. Default: no cut beyond the model's maximum length.",
    )
    model: str | None = Field(
        None,
        description="Which served reranker scores the pairs, by name; default: the first "
        "reranker the server was started with. Unknown: 404 model_not_found.",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Deadline in seconds from arrival, as on /v1/infer; capped by the server's "
        "max_timeout_s. The X-Timeout-S header does the same; given both, the smaller wins.",
    )
    priority: int = Field(
        0,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="Higher runs first, as on /v1/infer (every document of the request).",
    )


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="The document's position in the request.")
    relevance_score: float = Field(
        description="The cross-encoder's logit through its activation (GET /v1/models: "
        "activation); sigmoid, from 0 to 1, unless its configuration names another."
    )
    document: RerankDocument | None = Field(None, description="With return_documents only.")


class RerankResponse(BaseModel):
    model: str
    results: list[RerankResult]
    usage: Usage
    request_id: str


router = APIRouter()
TimeoutParameter = Annotated[
    float | None,
    Header(
        alias=TIMEOUT_HEADER, gt=0, allow_inf_nan=False,
        description="Deadline in seconds, as timeout_s; the smaller wins.",
    ),
]  # fmt: skip
_RERANK_BODY = TypeAdapter(RerankRequest)


@dataclass(frozen=True, slots=True)
class Ranking:
    """One rerank request's answer before it takes a protocol's shape."""

    model: str
    ranked: list[int]
    """The documents' indices, best first, at most ``top_n`` of them."""
    scores: list[float]
    """Every document's score, by index."""
    num_tokens: int
    request_id: str


async def rank_documents(
    request: Request, *, model: str | None, query: str, documents: list[str],
    top_n: int | None, endpoint: str, truncation_direction: str | None = None,
    max_tokens_per_doc: int | None = None, timeout_s: float | None = None, priority: int = 0,
    schema_status: int = 422, raw_scores: bool = False,
) -> Ranking:  # fmt: skip
    """Score ``documents`` against ``query`` with the reranker ``model`` names (None: the
    first) and rank them: the checks and the work every rerank route shares. Up to
    ``--max-rerank-documents`` documents; past ``--max-inputs-per-request`` they enter the
    queue in pieces (``server/runtime/pieces``). The deadline is the smaller of
    ``timeout_s`` and the ``X-Timeout-S`` header (neither: the server's default).
    ``schema_status``: the route's status for a schema error (as ``check_inputs``).
    ``raw_scores``: the scores before the model's score function (``raw``)."""
    header_timeout, header_errors = timeout_header(request)
    if header_errors:
        raise RequestValidationError(header_errors)
    asked = [t for t in (timeout_s, header_timeout) if t is not None]
    slot = slot_for_task(request, model, ("rerank",), endpoint, default_task="rerank")
    if not query:
        raise ApiError(400, "empty_input", "query is empty")
    if not documents:
        raise ApiError(400, "empty_input", "documents is empty")
    runtime = request.app.state.runtime
    limit = runtime.config.max_rerank_documents
    if len(documents) > limit:
        raise ApiError(
            413, "too_many_inputs",
            f"{len(documents)} documents, more than the limit of {limit} "
            "(--max-rerank-documents)",
        )  # fmt: skip
    check_inputs(runtime, [query], field="query", schema_status=schema_status)
    check_inputs(runtime, documents, field="documents", limit=limit, schema_status=schema_status)
    if top_n is not None and top_n < 1:
        raise ApiError(422, "invalid_top_n", f"top_n must be at least 1, got {top_n}")
    # A limit, as Cohere and Jina read it: LangChain's rerankers send top_n=3 whatever the
    # number of candidates.
    top_n = len(documents) if top_n is None else min(top_n, len(documents))
    if raw_scores and slot.info.activation not in RAW_INVERSES:
        raise ApiError(
            400, "unsupported_parameter",
            f"raw_scores needs a sigmoid or identity score function; {slot.name!r} scores with "
            f"{slot.info.activation}",
        )  # fmt: skip
    request_id = request_id_of(request)
    scores, num_tokens = await infer_for_request(
        request, documents, request_id=request_id, model=slot.name, query=query,
        truncation_direction=truncation_direction, max_tokens_per_doc=max_tokens_per_doc,
        timeout_s=min(asked, default=None), priority=priority,
    )  # fmt: skip
    if raw_scores:
        scores = [RAW_INVERSES[slot.info.activation](score) for score in scores]
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    return Ranking(slot.name, ranked, scores, num_tokens, request_id)


RAW_LIMIT = 36.0
"""A sigmoid's score keeps its logit within this far from 0 (float64 rounds to 0 and 1
beyond); raw scores past it are cut to it."""


def _logit(score: float) -> float:
    if score <= 0.0 or score >= 1.0:
        return math.copysign(RAW_LIMIT, score - 0.5)
    raw = math.log(score) - math.log1p(-score)
    return max(-RAW_LIMIT, min(RAW_LIMIT, raw))


RAW_INVERSES: dict[str | None, Callable[[float], float]] = {"sigmoid": _logit, "identity": float}
"""Scores back to what the model's score function was given, by its name."""


async def handle_rerank(request: Request) -> ASGIApp:
    """``POST /v1/rerank`` on the lean path (``server/lean``)."""
    body = parse_body(_RERANK_BODY, await read_json_request(request))
    ranking = await rank_documents(
        request, model=body.model, query=body.query, documents=body.documents,
        top_n=body.top_n, endpoint="/v1/rerank",
        truncation_direction=body.truncation_direction,
        max_tokens_per_doc=body.max_tokens_per_doc, timeout_s=body.timeout_s,
        priority=body.priority, raw_scores=body.raw_scores,
    )  # fmt: skip
    return JsonAnswer(encode_rerank_answer(ranking, body.documents, body.return_documents))


def encode_rerank_answer(ranking: Ranking, documents: list[str], return_documents: bool) -> bytes:
    results = []
    for index in ranking.ranked:
        result: dict[str, object] = {"index": index, "relevance_score": ranking.scores[index]}
        if return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    return encode_json(
        {
            "model": ranking.model,
            "results": results,
            "usage": {"input_tokens": ranking.num_tokens},
            "request_id": ranking.request_id,
        }
    )


# The OpenAPI entry of POST /v1/rerank; ``handle_rerank`` serves it (``server/lean``).
async def rerank(
    body: RerankRequest, request: Request, x_timeout_s: TimeoutParameter = None
) -> Response:
    raise AssertionError("handle_rerank serves this route")


router.add_api_route(
    "/v1/rerank",
    rerank,
    methods=["POST"],
    response_model=RerankResponse,
    response_model_exclude_none=True,
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_serving), Depends(require_json)],
    summary="Rerank documents against a query (cross-encoder)",
    route_class_override=lean_route(
        handle_rerank, render=error_response, validation=validation_error
    ),
)
