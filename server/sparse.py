"""``POST /embed_sparse``: sparse (SPLADE) vectors in text-embeddings-inference's shape.

A sentence-transformers ``SparseEncoder`` (task ``sparse``) answers it: one list per input
of its non-zero entries, ``{"index": vocabulary position, "value": weight}`` by ascending
index. Each input is one queue item, as on ``/v1/infer``, which serves the same vectors as
``{"indices": [...], "values": [...]}``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Request
from pydantic import BaseModel, ConfigDict, Field, RootModel, TypeAdapter, WithJsonSchema
from starlette.responses import Response
from starlette.types import ASGIApp

from .errors import error_response, request_id_of, validation_error
from .inference import check_inputs, infer_for_request, slot_for_task
from .lean import JsonAnswer, encode_json, lean_route
from .routes import (
    ERROR_RESPONSES,
    TIMEOUT_HEADER,
    parse_with_timeout,
    read_json_request,
    require_json,
    require_serving,
)
from .schemas import INPUTS_SCHEMA, MAX_PRIORITY, MIN_PRIORITY

# text-embeddings-inference spells the direction Right and Left; both spellings are taken.
_DIRECTIONS = {"right": "right", "left": "left", "Right": "right", "Left": "left"}


class EmbedSparseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    inputs: Annotated[str | list[str], WithJsonSchema(INPUTS_SCHEMA)] = Field(
        description="One text or a list of texts; no empty ones (400 empty_input)."
    )
    truncate: bool = Field(
        True,
        description="Cut inputs to the model's maximum length; when false an over-long input "
        "gets 413.",
    )
    truncation_direction: Literal["right", "left", "Right", "Left"] | None = Field(
        None,
        description="Which end truncation cuts from: right keeps the start, left the end. "
        "Default: the model's own.",
    )
    prompt_name: str | None = Field(
        None,
        description="One of the model's prompts, put in front of every input; an unknown "
        "name gets 400 unknown_prompt. Default: the model's default prompt, if it has one.",
    )
    model: str | None = Field(
        None,
        description="Which served sparse embedder runs the inputs, by name; default: the "
        "first sparse embedder the server was started with. Unknown: 404 model_not_found.",
    )
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="As on POST /v1/infer.")
    timeout_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="Deadline in seconds from arrival, as on POST /v1/infer (the "
        "X-Timeout-S header does the same; given both, the smaller wins).",
    )  # fmt: skip


class SparseValue(BaseModel):
    index: int = Field(description="Position in the model's vocabulary (its token id).")
    value: float = Field(description="The weight; never 0 (zeros are left out).")


EmbedSparseResponse = RootModel[list[list[SparseValue]]]

router = APIRouter()
_BODY = TypeAdapter(EmbedSparseRequest)


async def handle_embed_sparse(request: Request) -> ASGIApp:
    """``POST /embed_sparse`` on the lean path (``server/lean``)."""
    body, header_timeout = parse_with_timeout(_BODY, request, await read_json_request(request))
    slot = slot_for_task(request, body.model, ("sparse",), "/embed_sparse", default_task="sparse")
    runtime = request.app.state.runtime
    inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(runtime, inputs)
    asked = [t for t in (body.timeout_s, header_timeout) if t is not None]
    direction = body.truncation_direction
    outputs, _ = await infer_for_request(
        request, inputs, request_id=request_id_of(request), truncate=body.truncate,
        timeout_s=min(asked, default=runtime.config.default_timeout_s), priority=body.priority,
        model=slot.name, prompt_name=body.prompt_name,
        truncation_direction=None if direction is None else _DIRECTIONS[direction],
    )  # fmt: skip
    return JsonAnswer(encode_json([vector.pairs() for vector in outputs]))


# The OpenAPI entry of POST /embed_sparse; ``handle_embed_sparse`` serves it (``server/lean``).
async def embed_sparse(
    body: EmbedSparseRequest,
    request: Request,
    x_timeout_s: Annotated[
        float | None,
        Header(
            alias=TIMEOUT_HEADER, gt=0, allow_inf_nan=False,
            description="Deadline in seconds, as timeout_s in the body; the smaller wins.",
        ),
    ] = None,
) -> Response:  # fmt: skip
    raise AssertionError("handle_embed_sparse serves this route")


router.add_api_route(
    "/embed_sparse",
    embed_sparse,
    methods=["POST"],
    response_model=EmbedSparseResponse,
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_serving), Depends(require_json)],
    summary="Sparse (SPLADE) vectors, as text-embeddings-inference answers them",
    route_class_override=lean_route(
        handle_embed_sparse, render=error_response, validation=validation_error
    ),
)
