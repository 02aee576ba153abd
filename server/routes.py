"""HTTP routes. Thin: validate, hand over to the runtime, shape the answer."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Header, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

from .errors import ApiError, draining, error_response, not_ready, request_id_of, to_api_error
from .inference import (
    ClientDisconnected,
    check_dimensions,
    check_inputs,
    check_top_k,
    infer_for_request,
    shape_outputs,
    slot_for_task,
)
from .runtime import Runtime
from .schemas import ErrorBody, InferRequest, InferResponse, ModelList, Status

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
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise ApiError(
            415, "unsupported_media_type", f"content type {media_type!r} is not application/json"
        )


@router.post(
    "/v1/infer",
    response_model=InferResponse,
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_serving), Depends(require_json)],
)
async def infer(
    body: InferRequest,
    request: Request,
    x_timeout_s: Annotated[
        float | None,
        Header(
            alias="X-Timeout-S", gt=0, allow_inf_nan=False,
            description="Deadline in seconds, as timeout_s in the body; the smaller wins.",
        ),
    ] = None,
) -> Response:  # fmt: skip
    runtime = _runtime(request)
    config = runtime.config
    request_id = request_id_of(request)
    slot = slot_for_task(request, body.model, ("embed", "classify"), "/v1/infer")
    inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_inputs(runtime, inputs)
    check_dimensions(slot.info, body.dimensions)
    check_top_k(slot.info, body.top_k)
    asked = [t for t in (body.timeout_s, x_timeout_s) if t is not None]
    timeout_s = min(asked, default=config.default_timeout_s)
    try:
        outputs, num_tokens = await infer_for_request(
            request, inputs, request_id=request_id, truncate=body.truncate,
            timeout_s=timeout_s, priority=body.priority, model=slot.name,
            prompt_name=body.prompt_name, prompt=body.prompt,
        )  # fmt: skip
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        return error_response(request, to_api_error(exc))
    return _json(
        {
            "model": slot.name,
            "outputs": shape_outputs(
                slot.info, outputs, dimensions=body.dimensions, top_k=body.top_k
            ),
            "usage": {"input_tokens": num_tokens},
            "request_id": request_id,
        }
    )


@router.get("/v1/models", response_model=ModelList, responses=NOT_READY_RESPONSES)
async def list_models(request: Request) -> Response:
    """Every served model, the default (the one requests without a model run on) first."""
    runtime = _runtime(request)
    if not runtime.slots:
        raise not_ready()
    return _json({"models": [slot.card() for slot in runtime.slots.values()]})


@router.get("/health/live", response_model=Status)
async def live() -> Response:
    """Answers whenever the event loop runs: never queued behind inference."""
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
