"""HTTP routes. Thin: validate, hand over to the runtime, shape the answer."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import orjson
from fastapi import APIRouter, Depends, Header, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp

from .encodings import FLOATS, check_encoding, encode_embeddings, one_embedding_type
from .errors import (
    ApiError,
    draining,
    error_response,
    not_ready,
    request_id_of,
    validation_error,
)
from .inference import (
    check_dimensions,
    check_inputs,
    check_top_k,
    infer_for_request,
    shape_outputs,
    slot_for_task,
)
from .lean import (
    JsonAnswer,
    encode_json,
    is_json_media_type,
    lean_route,
    parse_body,
    read_body,
    validation_errors,
)
from .protocols.openai import OpenAIErrorBody, openai_error_response
from .protocols.routes import protocol_route
from .schemas import ErrorBody, InferRequest, InferResponse, ModelList, Status

if TYPE_CHECKING:  # the engine's; an API process never imports it (nor torch)
    from .runtime import Runtime

RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}
}


def _error_responses(descriptions: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    return {
        code: {"model": ErrorBody, "description": description}
        | ({"headers": RETRY_AFTER} if code in (429, 503) else {})
        for code, description in descriptions.items()
    }


ERROR_RESPONSES = _error_responses(
    {
        400: "Unparsable body, empty input, a model of another task, an unknown prompt name, "
        "dimensions out of range",
        401: "Missing or wrong API key (when the server requires one)",
        404: "No model of that name is served (model_not_found)",
        413: "Body, input count or input length too large",
        415: "Body is not JSON",
        422: "Schema error",
        429: "Queue full; see Retry-After",
        503: "Not ready or draining; see Retry-After",
        504: "Deadline passed",
        507: "An input does not fit in memory even alone",
        500: "Unexpected error",
    }
)
NOT_READY_RESPONSES = _error_responses({503: "Not ready or draining; see Retry-After"})

router = APIRouter()


def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def _json(body: Any, status_code: int = 200) -> Response:
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status_code,
        media_type="application/json",
    )


async def require_serving(request: Request) -> None:
    """Refuse new work at once while draining, so Nginx retries it on another replica."""
    if _runtime(request).draining:
        raise draining()


async def require_json(request: Request) -> None:
    """Refuse a body declared as something other than JSON (415); no header means JSON.

    NOTE: async on purpose: FastAPI runs a plain ``def`` dependency in its thread pool, a
    thread hop (and a worker thread) per request."""
    content_type = request.headers.get("content-type")
    if not is_json_media_type(content_type):
        media_type = (content_type or "").split(";", 1)[0].strip().lower()
        raise ApiError(
            415, "unsupported_media_type", f"content type {media_type!r} is not application/json"
        )


async def read_json_request(request: Request) -> bytes:
    """The body of a request to one of our JSON routes: 503 while draining (Nginx retries it
    elsewhere), 415 for a body declared as something else."""
    body = await read_body(request.receive)
    await require_serving(request)
    await require_json(request)
    return body


Body = TypeVar("Body")
TimeoutHeader = Annotated[float, Field(gt=0, allow_inf_nan=False)]
TIMEOUT_HEADER = "X-Timeout-S"
_INFER_BODY = TypeAdapter(InferRequest)
_TIMEOUT_HEADER = TypeAdapter(TimeoutHeader)


def timeout_header(request: Request) -> tuple[float | None, list[dict[str, Any]]]:
    """``X-Timeout-S`` as a number, or the errors FastAPI would report for it."""
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None, []
    try:
        return _TIMEOUT_HEADER.validate_python(value), []
    except ValidationError as exc:
        return None, [
            {**error, "loc": ("header", TIMEOUT_HEADER)} for error in validation_errors(exc)
        ]


def parse_infer_request(request: Request, raw: bytes) -> tuple[InferRequest, float | None]:
    """The body and the timeout header, failing as one schema error for both."""
    return parse_with_timeout(_INFER_BODY, request, raw)


def parse_with_timeout(
    adapter: TypeAdapter[Body], request: Request, raw: bytes
) -> tuple[Body, float | None]:
    """A body of ``adapter``'s type and the timeout header, failing as one schema error for
    both."""
    header_timeout, header_errors = timeout_header(request)
    try:
        body = parse_body(adapter, raw)
    except RequestValidationError as exc:
        if not header_errors or any(e["type"] == "json_invalid" for e in exc.errors()):
            raise
        raise RequestValidationError([*header_errors, *exc.errors()]) from None
    if header_errors:
        raise RequestValidationError(header_errors)
    return body, header_timeout


async def handle_infer(request: Request) -> ASGIApp:
    """``POST /v1/infer`` on the lean path (``server/lean``)."""
    body, header_timeout = parse_infer_request(request, await read_json_request(request))
    runtime = _runtime(request)
    request_id = request_id_of(request)
    slot = slot_for_task(request, body.model, ("embed", "classify", "sparse"), "/v1/infer")
    inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(runtime, inputs)
    check_dimensions(slot.info, body.dimensions, name=slot.name)
    check_top_k(slot.info, body.top_k, name=slot.name)
    encoding = check_encoding(
        slot.info, slot.name, kind=one_embedding_type(body.embedding_types),
        encoding_format=body.encoding_format, embed_dtype=body.embed_dtype,
    )  # fmt: skip
    asked = [t for t in (body.timeout_s, header_timeout) if t is not None]
    timeout_s = min(asked, default=runtime.config.default_timeout_s)
    outputs, num_tokens = await infer_for_request(
        request, inputs, request_id=request_id, truncate=body.truncate,
        timeout_s=timeout_s, priority=body.priority, model=slot.name,
        prompt_name=body.prompt_name, prompt=body.prompt, dimensions=body.dimensions,
        truncation_direction=body.truncation_direction, late_chunks=body.late_chunks,
    )  # fmt: skip
    outputs = shape_outputs(slot.info, outputs, top_k=body.top_k)
    if encoding != FLOATS:
        outputs = encode_embeddings(outputs, encoding)
    return JsonAnswer(encode_infer_answer(slot.name, outputs, num_tokens, request_id))


def encode_infer_answer(model: str, outputs: list[Any], num_tokens: int, request_id: str) -> bytes:
    return encode_json(
        {
            "model": model,
            "outputs": outputs,
            "usage": {"input_tokens": num_tokens},
            "request_id": request_id,
        }
    )


# The OpenAPI entry of POST /v1/infer; ``handle_infer`` serves it (``server/lean``).
async def infer(
    body: InferRequest,
    request: Request,
    x_timeout_s: Annotated[
        float | None,
        Header(
            alias=TIMEOUT_HEADER, gt=0, allow_inf_nan=False,
            description="Deadline in seconds, as timeout_s in the body; the smaller wins.",
        ),
    ] = None,
) -> Response:  # fmt: skip
    raise AssertionError("handle_infer serves this route")


router.add_api_route(
    "/v1/infer",
    infer,
    methods=["POST"],
    response_model=InferResponse,
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_serving), Depends(require_json)],
    route_class_override=lean_route(
        handle_infer, render=error_response, validation=validation_error
    ),
)


STARTED_S = int(time.time())
"""OpenAI's ``created`` for every model: when this process started (it imports this module
as it starts).

NOTE: not the model folder's mtime: a custom factory's model has no folder, a hub model's is
its download into the cache (so it differs between replicas anyway), and an API process
(``--api-workers``) never sees the folder. This number exists in every process and stays the
same for its life, so a client that caches the list never sees it change under it."""
OWNED_BY = "batchfit"


class OpenAIModel(BaseModel):
    id: str = Field(description="The served model's name (its card's name).")
    object: Literal["model"] = "model"
    created: int = Field(description="When the answering process started (Unix seconds).")
    owned_by: str = Field(OWNED_BY, description=f"Always {OWNED_BY!r}.")


class ModelListResponse(ModelList):
    object: Literal["list"] = "list"
    data: list[OpenAIModel] = Field(
        description="The same models as OpenAI's List models answers them, for its clients."
    )


def openai_model(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": STARTED_S, "owned_by": OWNED_BY}


@router.get("/v1/models", response_model=ModelListResponse, responses=NOT_READY_RESPONSES)
async def list_models(request: Request) -> Response:
    """Every served model, the default (the one requests without a model run on) first: our
    cards under ``models``, OpenAI's model objects under ``data`` (its clients'
    ``models.list()``)."""
    runtime = _runtime(request)
    if not runtime.slots:
        raise not_ready()
    slots = list(runtime.slots.values())
    return _json(
        {
            "models": [slot.card() for slot in slots],
            "object": "list",
            "data": [openai_model(slot.name) for slot in slots],
        }
    )


def _openai_error(request: Request, error: ApiError) -> Response:
    """An error in OpenAI's shape; an unknown model's ``param`` is ``model``, as OpenAI's."""
    param = "model" if error.error_type == "model_not_found" else None
    return openai_error_response(request, error, param)


# OpenAI's routes live in protocols/openai.py; this one sits beside GET /v1/models.
_openai_router = APIRouter(
    tags=["OpenAI"], route_class=protocol_route(_openai_error, validation_status=400)
)


@_openai_router.get(
    "/v1/models/{name:path}",
    response_model=OpenAIModel,
    responses={
        404: {
            "model": OpenAIErrorBody,
            "description": "No model of that name is served (model_not_found)",
        },
        503: {"model": OpenAIErrorBody, "description": "Not ready or draining; see Retry-After"},
    },
    summary="Retrieve a model (OpenAI-compatible)",
)
async def retrieve_model(name: str, request: Request) -> Response:
    """One served model as OpenAI's Retrieve model answers it (its clients'
    ``models.retrieve(name)``); errors in OpenAI's shape."""
    # {name:path}: a hub model serves under its hub name, which has a slash.
    return _json(openai_model(_runtime(request).slot(name).name))


router.include_router(_openai_router)


@router.get(
    "/health/live", response_model=Status,
    responses=_error_responses(
        {503: "Hung: a forward pass past --forward-timeout-s, or a silent engine process"}
    ),
)  # fmt: skip
async def live(request: Request) -> Response:
    """Answers whenever the event loop runs, never queued behind inference; 503 where a
    forward pass has run past ``--forward-timeout-s`` (a hung device or model), or where the
    replica's engine process (``--api-workers``) has stopped answering this one."""
    problem = _runtime(request).liveness_problem()
    if problem is not None:
        return error_response(request, problem)
    return _json({"status": "live"})


@router.get("/health/ready", response_model=Status, responses=NOT_READY_RESPONSES)
async def ready(request: Request) -> Response:
    runtime = _runtime(request)
    if runtime.draining:
        return error_response(request, draining())
    if not runtime.ready:
        return error_response(request, not_ready())
    return _json({"status": "ready"})


def metrics_response(registry: CollectorRegistry) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
