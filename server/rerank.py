"""``POST /v1/rerank``: score documents against a query with a cross-encoder.

The request and response follow the widely used rerank APIs: results sorted by
``relevance_score`` (the model's one logit through the activation its configuration names,
sigmoid when it names none), descending. Each (query, document)
pair is one queue item whose cost is the pair's token count after truncation.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WithJsonSchema
from starlette.responses import Response
from starlette.types import ASGIApp

from .errors import ApiError, error_response, request_id_of, validation_error
from .inference import check_inputs, infer_for_request, slot_for_task
from .lean import JsonAnswer, encode_json, lean_route, parse_body
from .routes import ERROR_RESPONSES, read_json_request, require_json, require_serving
from .schemas import Usage

_TEXT = {"type": "string", "minLength": 1}


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    query: Annotated[str, WithJsonSchema(_TEXT)] = Field(
        description="The text the documents are scored against; not empty (400 empty_input)."
    )
    documents: Annotated[list[str], WithJsonSchema({"type": "array", "items": _TEXT})] = Field(
        description="The texts to score; at least one, at most the server's "
        "max_inputs_per_request (413 too_many_inputs), none empty (400 empty_input)."
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
    truncation_direction: Literal["right", "left"] | None = Field(
        None,
        description="Which end truncation cuts a pair from (the longer side first): right "
        "keeps the start, left the end. Default: the model's own.",
    )
    model: str | None = Field(
        None,
        description="Which served reranker scores the pairs, by name; default: the first "
        "reranker the server was started with. Unknown: 404 model_not_found.",
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
_RERANK_BODY = TypeAdapter(RerankRequest)


async def handle_rerank(request: Request) -> ASGIApp:
    """``POST /v1/rerank`` on the lean path (``server/lean``)."""
    body = parse_body(_RERANK_BODY, await read_json_request(request))
    slot = slot_for_task(request, body.model, ("rerank",), "/v1/rerank", default_task="rerank")
    if not body.query:
        raise ApiError(400, "empty_input", "query is empty")
    if not body.documents:
        raise ApiError(400, "empty_input", "documents is empty")
    runtime = request.app.state.runtime
    check_inputs(runtime, [body.query], field="query")
    check_inputs(runtime, body.documents, field="documents")
    if body.top_n is not None and body.top_n < 1:
        raise ApiError(422, "invalid_top_n", f"top_n must be at least 1, got {body.top_n}")
    # A limit, as Cohere and Jina read it: LangChain's rerankers send top_n=3 whatever the
    # number of candidates.
    top_n = len(body.documents) if body.top_n is None else min(body.top_n, len(body.documents))
    request_id = request_id_of(request)
    scores, num_tokens = await infer_for_request(
        request, body.documents, request_id=request_id, model=slot.name, query=body.query,
        truncation_direction=body.truncation_direction,
    )  # fmt: skip
    return JsonAnswer(encode_rerank_answer(body, slot.name, scores, top_n, num_tokens, request_id))


def encode_rerank_answer(
    body: RerankRequest, model: str, scores: list[float], top_n: int, num_tokens: int,
    request_id: str,
) -> bytes:  # fmt: skip
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    results = []
    for index in ranked:
        result: dict[str, object] = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            result["document"] = {"text": body.documents[index]}
        results.append(result)
    return encode_json(
        {
            "model": model,
            "results": results,
            "usage": {"input_tokens": num_tokens},
            "request_id": request_id,
        }
    )


# The OpenAPI entry of POST /v1/rerank; ``handle_rerank`` serves it (``server/lean``).
async def rerank(body: RerankRequest, request: Request) -> Response:
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
