"""Open Inference Protocol (KServe v2) REST: health, metadata and inference.

Text goes in as one BYTES tensor named ``text``; embeddings come out as an FP32 tensor
``embedding`` of shape [N, dim] (classifiers: BYTES ``label`` and FP32 ``score``; sparse
embedders: their non-zero entries as INT64 ``indices`` and FP32 ``values``, input ``i``'s
from ``offsets[i]`` to ``offsets[i + 1]``, as a CSR matrix stores its rows). Errors are
``{"error": message}`` as the protocol defines. Triton's binary tensor data extension is
supported for inputs and outputs, so tritonclient works with its defaults; the tensors are
decoded and encoded in ``kserve_tensors.py``.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from fastapi import APIRouter, Request
from pydantic import TypeAdapter
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from models import ModelInfo

from ..errors import ApiError, draining, not_ready, request_id_of
from ..inference import (
    check_inputs,
    check_prompt,
    infer_for_request,
    runtime_of,
    shape_outputs,
    task_hint,
)
from ..lean import (
    lean_route,
    method_not_allowed,
    parse_body,
    read_body,
    require_json_media_type,
)
from ..long_inputs import TRUNCATE_MODES
from ..runtime import ModelSlot
from .kserve_schemas import (
    HEADER_LENGTH,
    REQUEST_BODY,
    InferenceRequest,
    InferenceResponse,
    LiveResponse,
    ModelMetadata,
    ModelReadyResponse,
    ReadyResponse,
    ServerMetadata,
    V2Error,
)
from .kserve_tensors import (
    INPUT_NAME,
    MODEL_VERSION,
    infer_response,
    input_texts,
    output_tensors,
    requested_outputs,
    split_body,
)
from .routes import protocol_route, protocol_validation, retry_headers

# Schema errors are 400 here, as the protocol answers them.
SCHEMA_STATUS = 400
# Besides JSON: Triton's binary tensor data (tritonclient sends no content type at all).
BINARY_MEDIA_TYPE = "application/octet-stream"


def v2_error_response(request: Request, error: ApiError) -> Response:
    return Response(
        orjson.dumps({"error": error.message}),
        status_code=error.status,
        headers=retry_headers(error),
        media_type="application/json",
    )


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": V2Error, "description": description}
    for code, description in {
        400: "Bad request: body, tensor name, datatype, shape or parameters",
        401: "Missing or wrong API key (when the server requires one)",
        404: "No such model (model_not_found) or version",
        413: "Body, input count or input length too large",
        429: "Queue full; see Retry-After",
        503: "Not ready or draining; see Retry-After",
        504: "Deadline passed",
        507: "An input does not fit in memory even alone",
        500: "Unexpected error",
    }.items()
}

_ProtocolRoute = protocol_route(v2_error_response, validation_status=SCHEMA_STATUS)


class V2Route(_ProtocolRoute):
    """A v2 route: a method it does not take gets 405 in the protocol's shape too."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.methods and scope["method"] not in self.methods:
            await method_not_allowed(scope, self.methods, v2_error_response)(scope, receive, send)
        else:
            await super().handle(scope, receive, send)


router = APIRouter(tags=["Open Inference Protocol v2"], route_class=V2Route)


def _json(body: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status_code, media_type="application/json")


def _slot(request: Request, name: str, version: str | None = None) -> ModelSlot:
    slot = runtime_of(request).slot(name)  # 404 model_not_found for a name not served
    request.state.model = slot.name
    if version is not None and version != MODEL_VERSION:
        raise ApiError(404, "not_found", f"model {name!r} has no version {version!r}")
    return slot


def _outputs_of(info: ModelInfo) -> list[dict[str, Any]]:
    if info.task == "rerank":  # listed in metadata; inference is POST /v1/rerank
        return [{"name": "score", "datatype": "FP32", "shape": [-1]}]
    if info.task == "generate":  # likewise; generation is POST /v1/completions
        return [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]
    if info.task == "classify":
        return [
            {"name": "label", "datatype": "BYTES", "shape": [-1]},
            {"name": "score", "datatype": "FP32", "shape": [-1]},
        ]
    if info.task == "sparse":
        return [
            {"name": "indices", "datatype": "INT64", "shape": [-1]},
            {"name": "values", "datatype": "FP32", "shape": [-1]},
            {"name": "offsets", "datatype": "INT64", "shape": [-1]},
        ]
    return [{"name": "embedding", "datatype": "FP32", "shape": [-1, info.output_dim or -1]}]


@router.get("/v2", response_model=ServerMetadata, summary="Server metadata")
async def server_metadata(request: Request) -> Response:
    return _json(
        {"name": "batchfit", "version": request.app.version, "extensions": ["binary_tensor_data"]}
    )


@router.get(
    "/v2/health/live",
    response_model=LiveResponse,
    responses={
        503: {
            "model": LiveResponse,
            "description": "Not live (a hung forward pass, or a silent engine)",
        }
    },
    summary="Server live (200 live, 503 not)",
)
async def server_live(request: Request) -> Response:
    live = runtime_of(request).liveness_problem() is None
    return _json({"live": live}, 200 if live else 503)


@router.get(
    "/v2/health/ready",
    response_model=ReadyResponse,
    responses={503: {"model": ReadyResponse, "description": "Not ready"}},
    summary="Server ready (200 ready, 503 not)",
)
async def server_ready(request: Request) -> Response:
    ready = runtime_of(request).ready
    return _json({"ready": ready}, 200 if ready else 503)


@router.get(
    "/v2/models/{name:path}/versions/{version}/ready",
    response_model=ModelReadyResponse, responses=ERRORS, summary="Model version ready",
)  # fmt: skip
async def model_version_ready(request: Request, name: str, version: str) -> Response:
    return _ready(request, name, version)


@router.get(
    "/v2/models/{name:path}/ready",
    response_model=ModelReadyResponse, responses=ERRORS, summary="Model ready",
)  # fmt: skip
async def model_ready(request: Request, name: str) -> Response:
    return _ready(request, name, None)


def _ready(request: Request, name: str, version: str | None) -> Response:
    ready = runtime_of(request).ready
    slot = _slot(request, name, version)
    return _json({"name": slot.name, "ready": ready}, 200 if ready else 503)


async def handle_infer(request: Request) -> ASGIApp:
    """Both v2 infer paths on the lean path (``server/lean``)."""
    params = request.path_params
    return await _infer(request, params["name"], params.get("version"))


_LEAN_ROUTE = lean_route(
    handle_infer, render=v2_error_response, validation=protocol_validation(SCHEMA_STATUS)
)
INFER_ERRORS = {
    **ERRORS,
    415: {"model": V2Error, "description": "Body declared as neither JSON nor binary data"},
}


# The OpenAPI entries of the v2 infer paths; ``handle_infer`` serves them (``server/lean``).
async def model_version_infer(request: Request, name: str, version: str) -> Response:
    raise AssertionError("handle_infer serves this route")


async def model_infer(request: Request, name: str) -> Response:
    raise AssertionError("handle_infer serves this route")


# NOTE: the version path first: {name:path} would take "m/versions/1" as a model name.
router.add_api_route(
    "/v2/models/{name:path}/versions/{version}/infer", model_version_infer, methods=["POST"],
    response_model=InferenceResponse, responses=INFER_ERRORS, openapi_extra=REQUEST_BODY,
    summary="Infer with a model version", route_class_override=_LEAN_ROUTE,
)  # fmt: skip
router.add_api_route(
    "/v2/models/{name:path}/infer", model_infer, methods=["POST"],
    response_model=InferenceResponse, responses=INFER_ERRORS, openapi_extra=REQUEST_BODY,
    summary="Infer", route_class_override=_LEAN_ROUTE,
)  # fmt: skip


_INFER_BODY = TypeAdapter(InferenceRequest)


async def _infer(request: Request, name: str, version: str | None) -> ASGIApp:
    runtime = runtime_of(request)
    if runtime.draining:  # first: Nginx retries a 503 draining on another replica
        raise draining()
    slot = _slot(request, name, version)
    info = slot.info
    if not runtime.ready:
        raise not_ready()
    if info.task not in ("embed", "classify", "sparse"):
        raise ApiError(
            400, "wrong_task",
            f"{slot.name} is a {info.task} model{task_hint(info.task)}",
        )  # fmt: skip
    raw = await read_body(request.receive)
    require_json_media_type(request.headers.get("content-type"), BINARY_MEDIA_TYPE)
    body, binary = split_body(raw, request.headers.get(HEADER_LENGTH))
    # Strict, as /v1/infer's body: true is no dimension of a shape.
    infer_request = parse_body(_INFER_BODY, body, strict=True)
    texts = input_texts(infer_request, binary)
    check_inputs(runtime, texts, field="input 'text'", schema_status=SCHEMA_STATUS)
    parameters = infer_request.parameters or {}
    truncate = parameters.get("truncate")
    timeout_s = parameters.get("timeout_s")
    if truncate is not None and not isinstance(truncate, bool) and truncate not in TRUNCATE_MODES:
        raise ApiError(
            400, "invalid_request",
            "parameter truncate must be a boolean or one of end, start, none, chunk",
        )  # fmt: skip
    if timeout_s is not None and (
        isinstance(timeout_s, bool)  # an int to Python, not a number of seconds
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise ApiError(400, "invalid_request", "parameter timeout_s must be a positive number")
    if not isinstance(parameters.get("binary_data_output", False), bool):
        raise ApiError(400, "invalid_request", "parameter binary_data_output must be a boolean")
    truncation_direction = parameters.get("truncation_direction")
    if truncation_direction not in (None, "right", "left"):
        raise ApiError(
            400, "invalid_request", "parameter truncation_direction must be right or left"
        )
    prompt_name, prompt = parameters.get("prompt_name"), parameters.get("prompt")
    for key, value in (("prompt_name", prompt_name), ("prompt", prompt)):
        if value is not None and not isinstance(value, str):
            raise ApiError(400, "invalid_request", f"parameter {key} must be a string")
    check_prompt(prompt_name, prompt, schema_status=SCHEMA_STATUS)
    known = [tensor["name"] for tensor in _outputs_of(info)]
    for output in infer_request.outputs or []:
        if output.name not in known:
            raise ApiError(
                400, "invalid_request", f"unknown output {output.name!r}; this model has {known}"
            )
        if not isinstance((output.parameters or {}).get("binary_data", False), bool):
            raise ApiError(
                400, "invalid_request", f"output {output.name!r}: binary_data must be a boolean"
            )
    outputs, _ = await infer_for_request(
        request, texts, request_id=request_id_of(request), truncate=truncate,
        timeout_s=timeout_s, model=slot.name, prompt_name=prompt_name, prompt=prompt,
        truncation_direction=truncation_direction, schema_status=SCHEMA_STATUS,
    )  # fmt: skip
    tensors = output_tensors(info, shape_outputs(info, outputs))
    wanted = requested_outputs(infer_request, tensors, parameters)
    return infer_response(slot.name, infer_request.id, wanted)


@router.get(
    "/v2/models/{name:path}/versions/{version}",
    response_model=ModelMetadata, responses=ERRORS, summary="Model version metadata",
)  # fmt: skip
async def model_version_metadata(request: Request, name: str, version: str) -> Response:
    return _metadata(request, name, version)


@router.get(
    "/v2/models/{name:path}", response_model=ModelMetadata, responses=ERRORS,
    summary="Model metadata",
)  # fmt: skip
async def model_metadata(request: Request, name: str) -> Response:
    return _metadata(request, name, None)


def _metadata(request: Request, name: str, version: str | None) -> Response:
    slot = _slot(request, name, version)
    info = slot.info
    return _json(
        {
            "name": slot.name,
            "versions": [MODEL_VERSION],
            "platform": "pytorch",
            "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
            "outputs": _outputs_of(info),
            "parameters": {
                "task": info.task,
                "device": info.device,
                "dtype": info.dtype,
                "quantize": info.quantize,
                "max_input_tokens": info.max_input_tokens,
            },
        }
    )
